"""The C++ paged decode kernel against dense SDPA over the same, gathered, context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.paged_decode import paged_decode

BLOCK = 16


def dense_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor, contexts: torch.Tensor, block_size: int = BLOCK
                    ) -> torch.Tensor:
    outs = []
    for b, context in enumerate(contexts.tolist()):
        slots = torch.cat([torch.arange(block_size) + block_size * block
                           for block in tables[b].tolist()])
        k, v = k_cache[slots[:context]], v_cache[slots[:context]]  # [T, Hkv, D]
        out = F.scaled_dot_product_attention(q[b][:, None], k.transpose(0, 1),
                                             v.transpose(0, 1), enable_gqa=True)
        outs.append(out[:, 0])
    return torch.stack(outs)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("contexts", "block_size"), [
    ([1], BLOCK), ([16, 17, 1, 40], BLOCK), ([5, 64, 33], BLOCK), ([700, 3], BLOCK),
    ([30, 49, 1], 24),  # blocks that are not whole vectors of scores
])
def test_kernel_matches_dense_attention(every_isa: str, contexts: list[int], block_size: int,
                                        dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(64 * block_size, 3, 64).to(dtype) for _ in range(2))
    k_cache[: 8 * block_size] *= 4  # a few blocks whose scores stand far above the rest
    width = -(-max(contexts) // block_size)
    tables = torch.stack([torch.randperm(64)[:width] for _ in contexts])  # scattered blocks
    q, lengths = torch.randn(len(contexts), 9, 64).to(dtype), torch.tensor(contexts)
    out = paged_decode(q, k_cache, v_cache, tables, lengths, block_size)
    assert out is not None and out.dtype == dtype
    # The kernel computes in fp32 from the bf16 cache: compare with fp32 attention over it.
    reference = dense_reference(q.float(), k_cache.float(), v_cache.float(), tables, lengths,
                                block_size)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.kernels
@pytest.mark.parametrize("head_dim", [16, 32, 48, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_dense_attention_at_every_head_dimension(every_isa: str, head_dim: int,
                                                                dtype: torch.dtype) -> None:
    """bf16 head dimensions that are multiples of 32, up to 128, take the AVX512-BF16 path on
    CPUs that have it; the others the 16-float one."""
    torch.manual_seed(1)
    k_cache, v_cache = (torch.randn(32 * BLOCK, 2, head_dim).to(dtype) for _ in range(2))
    tables = torch.stack([torch.randperm(32)[:4] for _ in range(3)])
    q, lengths = torch.randn(3, 4, head_dim).to(dtype), torch.tensor([64, 1, 37])
    out = paged_decode(q, k_cache, v_cache, tables, lengths, BLOCK)
    assert out is not None
    reference = dense_reference(q.float(), k_cache.float(), v_cache.float(), tables, lengths)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("q_dtype", "cache_dtype", "head_dim"), [
    (torch.float16, torch.float16, 64),  # a dtype the kernel does not read
    (torch.float32, torch.bfloat16, 64),  # query and cache differ
    (torch.float32, torch.float32, 24),  # not a whole number of 16-float vectors
])
def test_kernel_declines_what_it_cannot_read(q_dtype: torch.dtype, cache_dtype: torch.dtype,
                                            head_dim: int) -> None:
    q = torch.randn(1, 9, head_dim, dtype=q_dtype)
    cache = torch.zeros(16, 3, head_dim, dtype=cache_dtype)
    assert paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                        torch.tensor([1]), BLOCK) is None
