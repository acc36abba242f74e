"""The C++ paged prefill kernel against causal SDPA over the same, gathered, context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.paged_prefill import paged_prefill

BLOCK = 16
needs_kernel = pytest.mark.usefixtures("prefill_kernel")


def causal_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
    """fp32 attention of q's rows (positions start..) over the gathered context."""
    context = start + q.shape[0]
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
    k, v = k_cache[slots].float(), v_cache[slots].float()
    visible = torch.arange(start, context)[:, None] >= torch.arange(context)[None, :]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)


def scattered_cache(blocks: int, block_size: int, kv_heads: int, head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = (torch.randn(blocks * block_size, kv_heads, head_dim).to(torch.bfloat16)
                        for _ in range(2))
    k_cache[: 4 * block_size] *= 4  # a few blocks whose scores stand far above the rest
    return k_cache, v_cache


@needs_kernel
@pytest.mark.parametrize(("start", "new", "block_size"), [
    (0, 1, BLOCK), (0, 37, BLOCK), (0, 256, BLOCK),  # a whole prompt, nothing cached
    (16, 16, BLOCK), (700, 45, BLOCK), (3, 1, BLOCK),  # a chunk after a cached prefix
    (30, 49, 24),  # blocks that are not whole tiles of 16 keys
])
def test_kernel_matches_causal_attention(start: int, new: int, block_size: int) -> None:
    torch.manual_seed(0)
    k_cache, v_cache = scattered_cache(64, block_size, 3, 64)
    table = torch.randperm(64)[: -(-(start + new) // block_size)]
    q = torch.randn(new, 9, 64).to(torch.bfloat16)
    out = paged_prefill(q, k_cache, v_cache, table, start, block_size)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape
    reference = causal_reference(q, k_cache, v_cache, table, start, block_size)
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (4, 4, 32), (8, 2, 96), (6, 3, 128), (5, 1, 64),  # row counts not multiples of four
])
def test_kernel_matches_causal_attention_at_every_shape(heads: int, kv_heads: int,
                                                        head_dim: int) -> None:
    torch.manual_seed(1)
    k_cache, v_cache = scattered_cache(16, BLOCK, kv_heads, head_dim)
    table = torch.randperm(16)[:5]
    q = torch.randn(19, heads, head_dim).to(torch.bfloat16)
    out = paged_prefill(q, k_cache, v_cache, table, 50, BLOCK)
    assert out is not None
    reference = causal_reference(q, k_cache, v_cache, table, 50, BLOCK)
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("dtype", "head_dim"), [
    (torch.float32, 64),  # the kernel reads bf16 only
    (torch.bfloat16, 48),  # not a whole number of 32-value vectors
    (torch.bfloat16, 256),  # beyond the kernel's registers
])
def test_kernel_declines_what_it_cannot_read(dtype: torch.dtype, head_dim: int) -> None:
    q = torch.randn(4, 2, head_dim, dtype=dtype)
    cache = torch.zeros(16, 2, head_dim, dtype=dtype)
    assert paged_prefill(q, cache, cache, torch.tensor([0]), 0, BLOCK) is None
