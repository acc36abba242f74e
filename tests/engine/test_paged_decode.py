"""The C++ paged decode kernel against dense SDPA over the same, gathered, context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.paged_decode import kernel, paged_decode

BLOCK = 16


def dense_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
    outs = []
    for b, context in enumerate(contexts.tolist()):
        slots = torch.cat([torch.arange(BLOCK) + BLOCK * block for block in tables[b].tolist()])
        k, v = k_cache[slots[:context]], v_cache[slots[:context]]  # [T, Hkv, D]
        out = F.scaled_dot_product_attention(q[b][:, None], k.transpose(0, 1),
                                             v.transpose(0, 1), enable_gqa=True)
        outs.append(out[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("contexts", [[1], [16, 17, 1, 40], [5, 64, 33]])
def test_kernel_matches_dense_attention(contexts: list[int], dtype: torch.dtype) -> None:
    if kernel() is None:
        pytest.skip("no C++ compiler here: the gather + SDPA path serves instead")
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(64 * BLOCK, 3, 64).to(dtype) for _ in range(2))
    width = -(-max(contexts) // BLOCK)
    tables = torch.stack([torch.randperm(64)[:width] for _ in contexts])  # scattered blocks
    q, lengths = torch.randn(len(contexts), 9, 64).to(dtype), torch.tensor(contexts)
    out = paged_decode(q, k_cache, v_cache, tables, lengths, BLOCK)
    assert out is not None and out.dtype == dtype
    # The kernel computes in fp32 from the bf16 cache: compare with fp32 attention over it.
    reference = dense_reference(q.float(), k_cache.float(), v_cache.float(), tables, lengths)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


def test_kernel_declines_other_dtypes() -> None:
    q = torch.randn(1, 9, 64, dtype=torch.float16)
    cache = torch.zeros(16, 3, 64, dtype=torch.float16)
    assert paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                        torch.tensor([1]), BLOCK) is None
