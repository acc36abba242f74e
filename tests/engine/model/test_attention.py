"""Attention planning: token layout, cache slots, decode/prefill split, masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import attend, plan_attention
from engine.model.batch import ForwardBatch
from engine.model.workspace import Workspace


def test_plan_lays_out_mixed_batch() -> None:
    batch = ForwardBatch([[10, 11, 12], [20], [30, 31]], [5, 2, 0], [[3, 1], [7], [4]])
    plan = plan_attention(batch, block_size=4)
    assert plan.token_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert plan.positions.tolist() == [5, 6, 7, 2, 0, 1]
    assert plan.slots.tolist() == [5, 6, 7, 30, 16, 17]
    assert plan.logit_rows.tolist() == [2, 3, 5]
    assert plan.decode is not None and plan.decode.rows.tolist() == [3]
    assert plan.decode.blocks.tolist() == [[7]]
    assert plan.decode.mask.flatten().tolist() == [0.0, 0.0, 0.0, float("-inf")]
    chunk, fresh = plan.prefills
    assert (chunk.begin, chunk.end, chunk.context_len, chunk.blocks.tolist()) == (0, 3, 8, [3, 1])
    assert chunk.mask is not None and chunk.mask.shape == (3, 8)
    assert chunk.mask.sum(dim=1).tolist() == [6, 7, 8]
    assert (fresh.begin, fresh.end, fresh.mask) == (4, 6, None)


def test_decode_plan_pads_to_the_longest_context() -> None:
    batch = ForwardBatch([[1], [2], [3]], [0, 9, 4], [[5], [0, 2, 6], [1, 3]])
    plan = plan_attention(batch, block_size=4)
    assert plan.decode is not None and not plan.prefills
    assert plan.decode.blocks.tolist() == [[5, 0, 0], [0, 2, 6], [1, 3, 0]]
    assert plan.decode.mask.shape == (3, 1, 1, 12)
    assert (plan.decode.mask == 0).sum(dim=-1).flatten().tolist() == [1, 10, 5]
    assert torch.equal(plan.slots, torch.tensor([20, 25, 12]))


def test_table_too_short_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        plan_attention(ForwardBatch([[1, 2]], [3], [[0]]), block_size=4)


@pytest.mark.parametrize("window", [None, 3, 6], ids=["all", "window3", "window6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attend_matches_causal_attention_over_each_context(dtype: torch.dtype,
                                                           window: int | None) -> None:
    """A chunk after a cached prefix, a whole prompt and a decode token in one batch, whichever
    kernels serve them here; under a sliding window, each query sees its `window` latest keys
    (with 6, the decode token's context of 5 fits the window, the others do not)."""
    torch.manual_seed(0)
    batch = ForwardBatch([[0] * 7, [0] * 5, [0]], [9, 0, 4], [[3, 1, 6, 0], [2, 5], [7, 4]])
    plan = plan_attention(batch, block_size=4, dtype=dtype, window=window)
    k_cache, v_cache = (torch.randn(32, 3, 64).to(dtype) for _ in range(2))
    q = torch.randn(batch.num_tokens, 9, 64).to(dtype)
    new_kv = k_cache[plan.slots], v_cache[plan.slots]
    out = attend(q, new_kv, k_cache, v_cache, plan, Workspace())
    row = 0
    for tokens, start, table in zip(batch.token_ids, batch.start_positions, batch.block_tables,
                                    strict=True):
        context = start + len(tokens)
        slots = (torch.tensor(table)[:, None] * 4 + torch.arange(4)).flatten()[:context]
        queries, keys = torch.arange(start, context)[:, None], torch.arange(context)[None, :]
        visible = (queries >= keys) & (keys > queries - (window or context))
        rows = slice(row, row + len(tokens))
        expected = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), k_cache[slots].float().transpose(0, 1),
            v_cache[slots].float().transpose(0, 1), attn_mask=visible, enable_gqa=True)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[rows].float(), expected.transpose(0, 1),
                                   atol=tolerance, rtol=tolerance)
        row += len(tokens)


def test_a_window_masks_only_where_it_hides_keys() -> None:
    batch = ForwardBatch([[0] * 3, [0] * 4, [0]], [0, 0, 6], [[1], [2], [3, 4]])
    plan = plan_attention(batch, block_size=4, window=3)
    fits, longer = plan.prefills
    assert (fits.windowed, fits.mask) == (False, None)
    assert longer.windowed and longer.mask is not None
    assert longer.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
    assert plan.decode is not None and plan.decode.windowed
    assert (plan.decode.mask == 0).flatten().tolist() == [False] * 4 + [True] * 3 + [False]


def test_a_sequence_asking_for_all_logits_gets_a_row_per_new_token() -> None:
    batch = ForwardBatch([[10, 11, 12], [20], [30, 31]], [5, 2, 0], [[3, 1], [7], [4]],
                         all_logits=[True, False, True])
    assert plan_attention(batch, block_size=4).logit_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert [batch.logit_rows(i) for i in range(3)] == [3, 1, 2]
