"""A prompt's causal attention read straight from the paged KV cache
(csrc/paged_prefill.cpp).

Deep into a long prompt, attention is most of a prefill step; the kernel reads the context
where it lies instead of gathering a copy first, and on a CPU with AVX512-BF16 multiplies bf16
pairs in hardware (torch's CPU flash attention ran at about a third of the bf16 projections'
speed there). Where the kernels run at `amx`, torch's flash attention multiplies bf16 on AMX
tiles and is the faster path for a bf16 cache (`kernel_is_faster`).
"""

from __future__ import annotations

import torch

from engine.kernels.cpu.build import chosen_isa, kernels_for

LANES = 16  # the kernel's vector width in floats: head dimensions must be a multiple
MAX_HEAD_DIM = 256


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  table: torch.Tensor, start: int, block_size: int) -> torch.Tensor | None:
    """Attention `[T, H, D]` of a prompt's new tokens `q` (positions start..start+T-1, their K
    and V already cached) over its context, or None where the kernel does not apply (not all
    fp32 or all bf16, a head dimension not a multiple of 16 up to 256, a cache seen through
    some of its heads only, no kernel built)."""
    dim = q.shape[-1]
    if dim % LANES or dim > MAX_HEAD_DIM or not (k_cache.is_contiguous()
                                                and v_cache.is_contiguous()):
        return None
    module = kernels_for(q, k_cache, v_cache)
    if module is None:
        return None
    return module.paged_prefill(q.contiguous(), k_cache, v_cache, table.contiguous(), start,
                                block_size)


def kernel_is_faster(dtype: torch.dtype) -> bool:
    """Whether the kernel beats torch's attention for a cache of `dtype`: everywhere but bf16
    at `amx` (there, on a Xeon with AMX, a 512-token prompt's whole forward took 159 ms with
    the kernel and 131 without; 256 new tokens after 1,536 cached, 241 and 130)."""
    return dtype is not torch.bfloat16 or chosen_isa().name != "amx"
