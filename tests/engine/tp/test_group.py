"""A step's batch as rank 0 sends it to the other ranks."""

from __future__ import annotations

from engine.model.batch import ForwardBatch
from engine.tp.group import decode_batch, encode_batch


def test_a_batch_survives_the_trip() -> None:
    batch = ForwardBatch(token_ids=[[5, 6, 7], [9], []][:2], start_positions=[0, 41],
                         block_tables=[[3], [8, 1, 4]])
    assert decode_batch(encode_batch(batch)) == batch
    scored = ForwardBatch(token_ids=[[5, 6, 7], [9]], start_positions=[0, 41],
                          block_tables=[[3], [8, 1, 4]], all_logits=[True, False])
    assert decode_batch(encode_batch(scored)) == scored
