"""Decode attention read straight from the paged KV cache (csrc/paged_decode.cpp).

Gathering every sequence's context into a dense tensor before attending costs three passes over
the KV per layer (read, write, read again); the kernel makes one, in 16-float vectors.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu.build import kernels_for

LANES = 16  # the kernel's vector width in floats: head dimensions must be a multiple
MAX_HEAD_DIM = 256


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, contexts: torch.Tensor, block_size: int
                 ) -> torch.Tensor | None:
    """Attention of one query token per sequence `[B, H, D]` over its cached context, in q's
    dtype, or None when the kernel does not apply (q and cache not both fp32 or both bf16, a
    head dimension not a multiple of 16 or over 256, a cache seen through some of its heads
    only, or no kernel built)."""
    fits = q.shape[-1] % LANES == 0 and q.shape[-1] <= MAX_HEAD_DIM \
        and k_cache.is_contiguous() and v_cache.is_contiguous()  # not a head slice (engine.tp)
    module = kernels_for(q, k_cache, v_cache) if fits else None
    if module is None:
        return None
    return module.paged_decode(q.contiguous(), k_cache, v_cache, tables, contexts, block_size)
