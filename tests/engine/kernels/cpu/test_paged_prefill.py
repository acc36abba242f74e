"""The C++ paged prefill kernel, fp32 and bf16 at every level this CPU runs, against causal SDPA
over the same, gathered, context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.paged_prefill import kernel_is_faster, paged_prefill

BLOCK = 16
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


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


def scattered_cache(blocks: int, block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = (torch.randn(blocks * block_size, kv_heads, head_dim).to(dtype)
                        for _ in range(2))
    k_cache[: 4 * block_size] *= 4  # a few blocks whose scores stand far above the rest
    return k_cache, v_cache


def assert_near(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to rounding; bf16 within its 8-bit mantissa (computed in fp32, rounded once)."""
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@DTYPES
@pytest.mark.parametrize(("start", "new", "block_size"), [
    (0, 1, BLOCK), (0, 37, BLOCK), (0, 256, BLOCK),  # a whole prompt, nothing cached
    (16, 16, BLOCK), (700, 45, BLOCK), (3, 1, BLOCK),  # a chunk after a cached prefix
    (30, 49, 24),  # blocks that are not whole tiles of 16 keys
])
def test_kernel_matches_causal_attention(every_isa: str, dtype: torch.dtype, start: int,
                                         new: int, block_size: int) -> None:
    torch.manual_seed(0)
    k_cache, v_cache = scattered_cache(64, block_size, 3, 64, dtype)
    table = torch.randperm(64)[: -(-(start + new) // block_size)]
    q = torch.randn(new, 9, 64).to(dtype)
    out = paged_prefill(q, k_cache, v_cache, table, start, block_size)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    assert_near(out, causal_reference(q, k_cache, v_cache, table, start, block_size), dtype)


@DTYPES
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (4, 4, 32), (8, 2, 96), (6, 3, 128), (5, 1, 64),  # row counts not multiples of four
    (4, 2, 16), (2, 1, 48), (2, 2, 256),  # beyond what bf16 pairs take: the 16-float walk
])
def test_kernel_matches_causal_attention_at_every_shape(every_isa: str, dtype: torch.dtype,
                                                        heads: int, kv_heads: int,
                                                        head_dim: int) -> None:
    torch.manual_seed(1)
    k_cache, v_cache = scattered_cache(16, BLOCK, kv_heads, head_dim, dtype)
    table = torch.randperm(16)[:5]
    q = torch.randn(19, heads, head_dim).to(dtype)
    out = paged_prefill(q, k_cache, v_cache, table, 50, BLOCK)
    assert out is not None
    assert_near(out, causal_reference(q, k_cache, v_cache, table, 50, BLOCK), dtype)


@pytest.mark.parametrize(("q_dtype", "cache_dtype", "head_dim"), [
    (torch.float16, torch.float16, 64),  # a dtype the kernel does not read
    (torch.float32, torch.bfloat16, 64),  # query and cache differ
    (torch.float32, torch.float32, 24),  # not a whole number of 16-float vectors
    (torch.float32, torch.float32, 272),  # beyond the kernel's head dimensions
])
def test_kernel_declines_what_it_cannot_read(q_dtype: torch.dtype, cache_dtype: torch.dtype,
                                            head_dim: int) -> None:
    q = torch.randn(4, 2, head_dim, dtype=q_dtype)
    cache = torch.zeros(16, 2, head_dim, dtype=cache_dtype)
    assert paged_prefill(q, cache, cache, torch.tensor([0]), 0, BLOCK) is None


def test_torch_attends_a_bf16_cache_where_the_kernels_run_at_amx(every_isa: str) -> None:
    assert kernel_is_faster(torch.float32)
    assert kernel_is_faster(torch.bfloat16) == (every_isa != "amx")
