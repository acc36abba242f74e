"""Decode attention, one step of every layer: the C++ kernel against gather + SDPA.

    python -m bench attention [--contexts 256x8,3400,256x7+3400,600x12] [--dtype bfloat16]

Shaped like the default model (30 layers, 9 query heads over 3 KV heads of 64). Each layer has
a cache of its own as big as a decode worker's (4,096 blocks of 16 tokens), and each sequence's
blocks lie scattered in it, so the KV is read from memory, as in serving, not from the CPU's
caches. Both paths attend over the same plan and must agree before they are timed. `256x7+3400`
is seven sequences of 256 tokens and one of 3,400.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.cpu.paged_decode import paged_decode
from engine.kv import huge_pages
from engine.kv.allocator import blocks_needed
from engine.model.attention import DecodePlan, gathered_decode, plan_attention
from engine.model.batch import ForwardBatch
from engine.model.workspace import Workspace

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
DEFAULT_CONTEXTS = "256x8,3400,256x7+3400,600x12"


@dataclass(frozen=True)
class AttentionFigure:
    contexts: str
    kv_megabytes: float  # K and V read in one step, all layers
    kernel_ms: float  # median step
    gathered_ms: float

    @property
    def speedup(self) -> float:
        return self.gathered_ms / self.kernel_ms

    @property
    def kernel_gb_per_s(self) -> float:
        return self.kv_megabytes / 1024 / (self.kernel_ms / 1000)


def parse_contexts(text: str) -> list[int]:
    """`256x7+3400` -> seven 256s and one 3400."""
    lengths: list[int] = []
    for part in text.split("+"):
        length, times, count = part.partition("x")
        lengths += [int(length)] * (int(count) if times else 1)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"not a list of positive context lengths: {text!r}")
    return lengths


def measure(specs: list[str], dtype: torch.dtype, repeats: int = 7,
            cache_blocks: int = 4096, layers: int = LAYERS) -> list[AttentionFigure]:
    """One figure per context spec, both paths timed over the same `layers` caches."""
    caches = layer_caches(layers, cache_blocks, dtype)
    return [_measure_one(spec, caches, dtype, repeats) for spec in specs]


def layer_caches(layers: int, cache_blocks: int, dtype: torch.dtype
                 ) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's K and V cache of random values, on the huge pages a worker's cache lives
    on (engine.kv.huge_pages)."""
    def cache() -> torch.Tensor:
        return huge_pages.zeros((cache_blocks * BLOCK, KV_HEADS, HEAD_DIM), dtype).normal_()
    return [(cache(), cache()) for _ in range(layers)]


def _measure_one(spec: str, caches: list[tuple[torch.Tensor, ...]], dtype: torch.dtype,
                 repeats: int) -> AttentionFigure:
    contexts = parse_contexts(spec)
    plan = _scattered_plan(contexts, caches[0][0].shape[0] // BLOCK, dtype)
    q = torch.randn(len(contexts), HEADS, HEAD_DIM).to(dtype)
    workspace = Workspace()

    def kernel(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        return paged_decode(q, k, v, plan.blocks, plan.contexts, BLOCK)

    def gathered(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return gathered_decode(q, k, v, plan, BLOCK, workspace)

    k, v = caches[0]
    fast = kernel(k, v)
    if fast is None:
        raise RuntimeError(f"the C++ kernel does not run here for {dtype}")
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.float(), gathered(k, v).float(), atol=tolerance,
                               rtol=tolerance)
    kv_bytes = sum(contexts) * 2 * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
    return AttentionFigure(spec, kv_bytes * len(caches) / 2**20,
                           median_step_ms(kernel, caches, repeats),
                           median_step_ms(gathered, caches, repeats))


def _scattered_plan(contexts: list[int], cache_blocks: int, dtype: torch.dtype) -> DecodePlan:
    """Each sequence decoding its last context token, its blocks drawn at random from the
    cache."""
    order = torch.randperm(cache_blocks).tolist()
    tables, taken = [], 0
    for context in contexts:
        count = blocks_needed(context, BLOCK)
        tables.append(order[taken:taken + count])
        taken += count
    if taken > cache_blocks:
        raise ValueError(f"contexts of {taken} blocks do not fit a {cache_blocks}-block cache")
    batch = ForwardBatch([[0]] * len(contexts), [c - 1 for c in contexts], tables)
    plan = plan_attention(batch, BLOCK, dtype).decode
    assert plan is not None
    return plan


def median_step_ms(attend: Callable[[torch.Tensor, torch.Tensor], object],
                    caches: list[tuple[torch.Tensor, ...]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in caches:
            attend(k, v)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def markdown(figures: list[AttentionFigure]) -> str:
    rows = ["| contexts | KV read, MiB | C++ kernel ms | gather + SDPA ms | speedup "
            "| kernel GiB/s |",
            "|---|---|---|---|---|---|"]
    rows += [f"| {f.contexts} | {f.kv_megabytes:.0f} | {f.kernel_ms:.1f} | {f.gathered_ms:.1f} "
             f"| {f.speedup:.2f}x | {f.kernel_gb_per_s:.1f} |" for f in figures]
    return "\n".join(rows)
