"""Prefill attention, one chunk through every layer: the C++ kernel against gather + SDPA.

    python -m bench prefill-attention [--chunks 256@0,256@2816] [--dtype bfloat16] [--threads 1]

Shaped like the default model (30 layers, 9 query heads over 3 KV heads of 64), in bf16 or
fp32. `256@2816` is a chunk of 256 new tokens after 2,816 cached ones,
the prompt's blocks scattered in a cache as big as a worker's. Both paths must agree before they
are timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.attention import BLOCK, HEAD_DIM, HEADS, LAYERS, layer_caches, median_step_ms
from engine.kernels.cpu.paged_prefill import paged_prefill
from engine.kv.allocator import blocks_needed
from engine.model.attention import PrefillPlan, gathered_prefill, plan_attention
from engine.model.batch import ForwardBatch
from engine.model.workspace import Workspace

DEFAULT_CHUNKS = "256@0,512@0,256@1024,256@2816,128@2944,32@3000"


@dataclass(frozen=True)
class PrefillFigure:
    chunk: str
    gflop: float  # the chunk's attention arithmetic, all layers (causal: visible keys only)
    kernel_ms: float  # median pass over every layer
    gathered_ms: float

    @property
    def speedup(self) -> float:
        return self.gathered_ms / self.kernel_ms

    @property
    def kernel_gflop_per_s(self) -> float:
        return self.gflop / (self.kernel_ms / 1000)


def parse_chunk(text: str) -> tuple[int, int]:
    """`256@2816` -> (256 new tokens, 2816 cached)."""
    new, at, start = text.partition("@")
    try:
        tokens, cached = int(new), int(start) if at else 0
    except ValueError:
        tokens, cached = 0, 0
    if tokens < 1 or cached < 0:
        raise ValueError(f"not a chunk NEW@CACHED: {text!r}")
    return tokens, cached


def measure(specs: list[str], repeats: int = 5, cache_blocks: int = 4096,
            layers: int = LAYERS, dtype: torch.dtype = torch.bfloat16) -> list[PrefillFigure]:
    """One figure per chunk spec, both paths timed over the same `layers` caches."""
    caches = layer_caches(layers, cache_blocks, dtype)
    return [_measure_one(spec, caches, repeats) for spec in specs]


def _measure_one(spec: str, caches: list[tuple[torch.Tensor, ...]],
                 repeats: int) -> PrefillFigure:
    tokens, cached = parse_chunk(spec)
    plan = _scattered_plan(tokens, cached, caches[0][0].shape[0] // BLOCK)
    q = torch.randn(tokens, HEADS, HEAD_DIM).to(caches[0][0].dtype)
    workspace = Workspace()

    def kernel(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        return paged_prefill(q, k, v, plan.blocks, cached, BLOCK)

    def gathered(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return gathered_prefill(q, k, v, plan, BLOCK, workspace)

    k, v = caches[0]
    fast = kernel(k, v)
    if fast is None:
        raise RuntimeError("the C++ prefill kernel does not run here (no kernels built)")
    torch.testing.assert_close(fast.float(), gathered(k, v).float(), atol=2e-2, rtol=2e-2)
    keys = tokens * cached + tokens * (tokens + 1) / 2  # causal: keys each new token sees
    gflop = keys * HEADS * HEAD_DIM * 4 * len(caches) / 1e9
    return PrefillFigure(spec, gflop, median_step_ms(kernel, caches, repeats),
                         median_step_ms(gathered, caches, repeats))


def _scattered_plan(tokens: int, cached: int, cache_blocks: int) -> PrefillPlan:
    count = blocks_needed(cached + tokens, BLOCK)
    if count > cache_blocks:
        raise ValueError(f"a context of {count} blocks does not fit a {cache_blocks}-block cache")
    table = torch.randperm(cache_blocks)[:count].tolist()
    (plan,) = plan_attention(ForwardBatch([[0] * tokens], [cached], [table]), BLOCK).prefills
    return plan


def markdown(figures: list[PrefillFigure]) -> str:
    rows = ["| new tokens @ cached | GFLOP | C++ kernel ms | gather + SDPA ms | speedup "
            "| kernel GFLOP/s |", "|---|---|---|---|---|---|"]
    rows += [f"| {f.chunk} | {f.gflop:.1f} | {f.kernel_ms:.1f} | {f.gathered_ms:.1f} "
             f"| {f.speedup:.2f}x | {f.kernel_gflop_per_s:.0f} |" for f in figures]
    return "\n".join(rows)
