"""Every weight product of one forward step, over the GGUF's quant blocks against dense.

    python -m bench quant [--rows 1,2,4,8,16,32] [--dtype bfloat16] [--threads 1] [--inputs int8]

The real model's 211 matrices (30 layers' q/k/v, o, gate/up and down, and the LM head), as a
worker holds them: dense in the layout its dtype gets (packed for oneDNN in bf16 on a CPU with
bf16 instructions, the mapped file in fp32), and as 4-bit (layers) and 8-bit (LM head) quant blocks,
multiplied with the inputs as they are or, with `--inputs int8`, quantized to 8 bits.
Each row count is timed both ways, the median of `repeats` passes over every matrix; the last
lines give the row count `model.quant_rows: -1` measures on this machine, and the bytes read per
second: every block once per pass (one row: a decode step of one sequence must read them all)
against a plain read of as many bytes of memory, in the same run, as the physical limit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from bench.report import table
from core.config import QuantInputs
from engine.locate import resolve_model
from engine.model.linear import Matrices, dense_products, quant_products
from engine.model.llama import LlamaModel
from engine.weights.load import load_weights
from engine.weights.quant_blocks import load_quant_blocks
from engine.weights.spec import load_spec

DEFAULT_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class ProductFigure:
    rows: int
    dense_ms: float  # every matrix once, median pass
    quant_ms: float

    @property
    def speedup(self) -> float:
        return self.dense_ms / self.quant_ms


def quant_bytes(matrices: list[Matrices]) -> int:
    """The bytes of every matrix's quant blocks: what one pass over them reads."""
    return sum(int(q.packed.numel()) for m in matrices for q in m.quant)


def memory_read_gbps(size: int, repeats: int) -> float:
    """GB/s of summing `size` bytes of float32 memory, too big for the caches, with torch's
    current threads: how fast this machine streams memory (torch sums int32 through int64,
    at a twentieth of the speed)."""
    data = torch.ones(max(size // 4, 1), dtype=torch.float32)
    return size / _median_ms(data.sum, repeats) / 1e6


def load_matrices(model: str, cache_dir: str, dtype: torch.dtype,
                  inputs: QuantInputs = "exact") -> list[Matrices]:
    """The model's matrices as a worker holds them, dense and in quant blocks."""
    folder = resolve_model(model, cache_dir)
    quant = load_quant_blocks(folder, inputs == "int8")
    if not quant:
        raise ValueError(f"{folder} has no quant blocks")
    weights = load_weights(folder, dtype)
    llama = LlamaModel(load_spec(folder), weights, quant=quant, quant_rows=0)
    matrices = [m for m in llama.matrices() if m.quant]
    if not matrices:
        raise ValueError("no quant products here: the C++ kernels could not be built")
    return matrices


def measure(matrices: list[Matrices], dtype: torch.dtype, rows: tuple[int, ...],
            repeats: int) -> list[ProductFigure]:
    """Both ways at each row count; they must agree before they are timed."""
    figures = []
    for count in rows:
        inputs = [torch.randn(count, m.quant[0].shape[1]).to(dtype) for m in matrices]
        for m, x in zip(matrices[:4], inputs, strict=False):
            for dense, over_quant in zip(m.dense_outputs(x), m.quant_outputs(x), strict=True):
                error = (over_quant.float() - dense.float()).abs().max()
                assert error <= 0.02 * dense.float().abs().max(), f"{count} rows: off by {error}"
        pairs = list(zip(matrices, inputs, strict=True))
        dense_ms = _median_ms(partial(dense_products, pairs), repeats)
        quant_ms = _median_ms(partial(quant_products, pairs), repeats)
        figures.append(ProductFigure(count, dense_ms, quant_ms))
    return figures


def _median_ms(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


def markdown(figures: list[ProductFigure], dtype: str, threads: int, inputs: QuantInputs,
             measured: int, blocks_bytes: int, read_gbps: float) -> str:
    rows = [[str(f.rows), f"{f.dense_ms:.1f}", f"{f.quant_ms:.1f}", f"{f.speedup:.2f}x",
             f"{blocks_bytes / f.quant_ms / 1e6:.1f}"] for f in figures]
    header = [f"rows ({dtype}, {threads} thread{'s' * (threads > 1)}, {inputs} inputs)",
              "dense ms",
              "quant ms", "dense / quant", "quant blocks GB/s"]
    return (table(header, rows) +
            f"\n\nrows taken over the quant blocks (model.quant_rows: -1): {measured}"
            f"\nquant blocks: {blocks_bytes / 1e6:.1f} MB; a plain read of as many bytes: "
            f"{read_gbps:.1f} GB/s")
