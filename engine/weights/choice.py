"""Which copy of each weight matrix a worker multiplies (`model.weights`): the dense one, the
quant blocks the model shipped in (engine.weights.quant_blocks), or both, the quant blocks for
products of few rows and the dense copy for the rest (engine.model.linear).

A folder prepared from a GGUF (engine.weights.gguf) holds some matrices as quant blocks only.
Multiplied over them alone, a worker keeps no copy of its own: the blocks are memory-mapped,
one copy in the page cache for every worker on the host. A dense copy, made at load by
dequantizing them, is the worker's own; it makes long prompt chunks faster (about 2.5x at 512
rows, bf16 on AMX), where memory allows it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from core.config import WeightsMode
from engine.weights.files import EMBED, LM_HEAD
from engine.weights.quant_blocks import QuantMatrix, dequantize

log = logging.getLogger(__name__)

DENSE_COPY_SHARE = 0.25  # auto: a dense copy is made if it takes at most this much of the
                         # memory available at load (other workers will want theirs)


def choose_weights(dense: dict[str, torch.Tensor], quant: dict[str, QuantMatrix],
                   mode: WeightsMode, dtype: torch.dtype, quant_usable: bool,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, QuantMatrix]]:
    """The dense weights and the quant blocks a model is built from, per `mode`:

    - quant: every matrix that has quant blocks is multiplied over them alone;
    - dense: every matrix has a dense copy (dequantized now where the folder has none);
    - auto: as the folder has them; where some matrices are quant blocks only, a dense copy
      of them too if it fits in a quarter of the memory available now.

    Where the quant blocks cannot be multiplied (`quant_usable` false: no C++ kernels, or a
    GPU), every matrix is dense, whatever `mode` says."""
    only_quant = [name for name in quant if name not in dense]
    if not quant_usable:
        return _with_dense_copies(dense, quant, only_quant, dtype), {}
    if mode == "quant":
        return _without_dense_copies(dense, quant), quant
    if mode == "dense" or (only_quant and _copy_fits(quant, only_quant, dtype)):
        return _with_dense_copies(dense, quant, only_quant, dtype), quant
    return dense, quant


def _with_dense_copies(dense: dict[str, torch.Tensor], quant: dict[str, QuantMatrix],
                       names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    copies = {name: dequantize(quant[name]).to(dtype) for name in names}
    weights = {**dense, **copies}
    if EMBED in copies and LM_HEAD not in weights:  # tied
        weights[LM_HEAD] = weights[EMBED]
    return weights


def _without_dense_copies(dense: dict[str, torch.Tensor],
                          quant: dict[str, QuantMatrix]) -> dict[str, torch.Tensor]:
    tied = LM_HEAD in dense and dense[LM_HEAD] is dense.get(EMBED)
    dropped = set(quant) | ({LM_HEAD} if tied and EMBED in quant else set())
    return {name: tensor for name, tensor in dense.items() if name not in dropped}


def _copy_fits(quant: dict[str, QuantMatrix], names: list[str], dtype: torch.dtype) -> bool:
    needed = sum(quant[name].shape[0] * quant[name].shape[1] for name in names) * dtype.itemsize
    available = available_memory()
    fits = needed <= DENSE_COPY_SHARE * available
    log.info("a dense copy of the %d matrices held only as quant blocks takes %.0f MB, %s: %s",
             len(names), needed / 2**20, f"{available / 2**20:.0f} MB available",
             "made" if fits else "not made (model.weights=dense makes it)")
    return fits


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of memory available to a new process now (MemAvailable)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable")
