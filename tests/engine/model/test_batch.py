"""ForwardBatch validation."""

from __future__ import annotations

import pytest

from engine.model.batch import ForwardBatch


def test_counts() -> None:
    batch = ForwardBatch([[1, 2, 3], [4]], [0, 7], [[0], [1, 2]])
    assert batch.num_seqs == 2 and batch.num_tokens == 4


@pytest.mark.parametrize(
    ("token_ids", "starts", "tables"),
    [
        ([], [], []),
        ([[1]], [0, 0], [[0]]),
        ([[1], []], [0, 0], [[0], [1]]),
        ([[1]], [-1], [[0]]),
    ],
)
def test_bad_batches_are_value_errors(
    token_ids: list[list[int]], starts: list[int], tables: list[list[int]]
) -> None:
    with pytest.raises(ValueError):
        ForwardBatch(token_ids, starts, tables)


def test_all_logits_needs_a_flag_per_sequence() -> None:
    with pytest.raises(ValueError):
        ForwardBatch([[1, 2], [3]], [0, 0], [[0], [1]], all_logits=[True])
