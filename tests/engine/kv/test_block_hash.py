"""Chained block hashes: equal prefixes and salts hash alike, anything else does not."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import block_hashes

BLOCK = 4
TOKENS = list(range(100, 118))  # 4 full blocks and 2 tokens over


def test_same_tokens_and_salt_give_the_same_hashes() -> None:
    first = block_hashes(TOKENS, BLOCK, "tenant-a")
    assert first == block_hashes(list(TOKENS), BLOCK, "tenant-a")
    assert len(set(first)) == len(first)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in first)


def test_a_different_salt_changes_every_hash() -> None:
    salted = block_hashes(TOKENS, BLOCK, "tenant-a")
    for other in ("tenant-b", ""):
        assert not set(salted) & set(block_hashes(TOKENS, BLOCK, other))


@pytest.mark.parametrize("block", [0, 1, 3])
def test_a_change_in_block_i_changes_hashes_from_i_on(block: int) -> None:
    changed = list(TOKENS)
    changed[block * BLOCK + 2] += 1
    before, after = block_hashes(TOKENS, BLOCK, ""), block_hashes(changed, BLOCK, "")
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


def test_the_partial_last_block_has_no_hash() -> None:
    assert len(block_hashes(TOKENS, BLOCK, "")) == len(TOKENS) // BLOCK
    assert block_hashes(TOKENS, BLOCK, "") == block_hashes(TOKENS[:16], BLOCK, "")
    assert block_hashes(TOKENS[:BLOCK - 1], BLOCK, "") == []
    assert block_hashes([], BLOCK, "") == []


def test_a_change_in_the_partial_block_changes_nothing() -> None:
    changed = [*TOKENS[:-1], TOKENS[-1] + 1]
    assert block_hashes(changed, BLOCK, "s") == block_hashes(TOKENS, BLOCK, "s")


def test_the_same_block_at_another_position_hashes_differently() -> None:
    repeated = [7, 7, 7, 7] * 3
    assert len(set(block_hashes(repeated, BLOCK, ""))) == 3


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0, "")
