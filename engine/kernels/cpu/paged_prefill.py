"""A prompt's causal attention read straight from the paged KV cache
(csrc/paged_prefill.cpp), for a bf16 cache on a CPU with AVX512-BF16.

Deep into a long prompt, attention is most of a prefill step, and torch's CPU flash attention
runs it at about a third of the speed of the bf16 projections here; the kernel multiplies bf16
pairs in hardware and reads the context without a gathered copy.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu.build import kernels, kernels_for


def prefill_kernel_built() -> bool:
    """Whether the kernels were built here, for a CPU with AVX512-BF16."""
    module = kernels()
    return module is not None and module.paged_prefill_built()


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  table: torch.Tensor, start: int, block_size: int) -> torch.Tensor | None:
    """Attention `[T, H, D]` of a prompt's new tokens `q` (positions start..start+T-1, their K
    and V already cached) over its context, or None where the kernel does not apply (not all
    bf16, a head dimension not 32-128 in steps of 32, no kernel built for this CPU)."""
    dim = q.shape[-1]
    if q.dtype != torch.bfloat16 or dim % 32 or dim > 128:
        return None
    module = kernels_for(q, k_cache, v_cache)
    if module is None or not prefill_kernel_built():
        return None
    return module.paged_prefill(q.contiguous(), k_cache, v_cache, table.contiguous(), start,
                                block_size)
