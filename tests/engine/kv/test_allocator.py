"""Block bookkeeping: allocation, ref counts, all-or-nothing, double frees."""

from __future__ import annotations

import pytest

from engine.kv.allocator import BlockAllocator, OutOfBlocks, blocks_needed


def test_blocks_needed_rounds_up() -> None:
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        blocks_needed(3, 0)


def test_allocate_hands_out_distinct_blocks_until_exhausted() -> None:
    allocator = BlockAllocator(10)
    first, second = allocator.allocate(4), allocator.allocate(6)
    assert sorted(first + second) == list(range(10))
    assert allocator.num_free == 0 and allocator.num_total == 10
    assert not allocator.can_allocate(1) and allocator.can_allocate(0)


def test_allocation_is_all_or_nothing() -> None:
    allocator = BlockAllocator(5)
    allocator.allocate(3)
    with pytest.raises(OutOfBlocks):
        allocator.allocate(3)
    assert allocator.num_free == 2
    assert len(allocator.allocate(2)) == 2


def test_freed_blocks_are_reused() -> None:
    allocator = BlockAllocator(3)
    blocks = allocator.allocate(3)
    allocator.free(blocks[1:2])
    assert allocator.num_free == 1
    assert allocator.allocate(1) == blocks[1:2]


def test_shared_block_is_free_only_after_last_reference() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.incref(blocks)
    assert allocator.ref_count(blocks[0]) == 2
    allocator.free(blocks)
    assert allocator.num_free == 2 and allocator.ref_count(blocks[0]) == 1
    allocator.free(blocks)
    assert allocator.num_free == 4 and allocator.ref_count(blocks[0]) == 0


def test_double_free_asserts_and_changes_nothing() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(AssertionError):
        allocator.free(blocks)
    assert allocator.num_free == 3 and allocator.ref_count(blocks[1]) == 1
    with pytest.raises(AssertionError):
        allocator.free([blocks[1], blocks[1]])


def test_incref_or_free_of_unknown_block_asserts() -> None:
    allocator = BlockAllocator(4)
    with pytest.raises(AssertionError):
        allocator.incref([0])
    with pytest.raises(AssertionError):
        allocator.free([-1])
    with pytest.raises(AssertionError):
        allocator.free([4])


def test_bad_sizes_are_value_errors() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(2).allocate(-1)
