"""The prefix cache's bookkeeping: matching, reference counts, LRU eviction (no tensors)."""

from __future__ import annotations

import pytest

from engine.kv.allocator import BlockAllocator, OutOfBlocks
from engine.kv.block_hash import block_hashes
from engine.kv.prefix_cache import PrefixCache

BLOCK = 4


def hashes(tokens: list[int], salt: str = "") -> list[bytes]:
    return block_hashes(tokens, BLOCK, salt)


def served(cache: PrefixCache, tokens: list[int], salt: str = "") -> tuple[list[int], int]:
    """One request as the prefill worker runs it: match, allocate the rest, insert, release.
    Returns its block table and how many of its blocks were reused."""
    chain = hashes(tokens, salt)
    reused = cache.match(chain)
    table = reused + cache.allocate(-(-len(tokens) // BLOCK) - len(reused))
    cache.insert(chain, table)
    cache.release(table)
    return table, len(reused)


def test_a_repeated_prefix_reuses_its_blocks() -> None:
    cache = PrefixCache(BlockAllocator(16))
    first, reused = served(cache, list(range(10)))  # 2 full blocks + 2 tokens
    assert reused == 0 and len(cache.blocks) == 2
    second, reused = served(cache, [*range(8), 50, 51, 52])
    assert reused == 2 and second[:2] == first[:2]
    assert cache.hits == 2
    assert all(cache.allocator.ref_count(b) == 1 for b in cache.blocks.values())  # idle
    assert cache.allocator.num_free == 16 - 2  # partial blocks went back


def test_another_salt_never_matches() -> None:
    cache = PrefixCache(BlockAllocator(16))
    served(cache, list(range(8)), salt="alpha")
    assert cache.match(hashes(list(range(8)), salt="beta")) == []
    assert len(cache.match(hashes(list(range(8)), salt="alpha"))) == 2


def test_a_match_stops_at_the_first_miss() -> None:
    cache = PrefixCache(BlockAllocator(16))
    served(cache, list(range(12)))
    other = [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11]  # block 1 differs, so block 2's hash does
    assert len(cache.match(hashes(other))) == 1


def test_matched_blocks_are_pinned_while_in_use() -> None:
    cache = PrefixCache(BlockAllocator(4))
    served(cache, list(range(8)))  # 2 cached, idle
    pinned = cache.match(hashes(list(range(8))))
    assert cache.num_available == 2  # the 2 free ones; the cached 2 are in use
    with pytest.raises(OutOfBlocks):
        cache.allocate(3)
    assert len(cache.blocks) == 2  # a failed allocation evicts nothing
    cache.release(pinned)
    assert cache.num_available == 4


def test_eviction_is_least_recently_used_first() -> None:
    cache = PrefixCache(BlockAllocator(4))
    served(cache, [1, 1, 1, 1])
    served(cache, [2, 2, 2, 2])
    served(cache, [3, 3, 3, 3])
    served(cache, [1, 1, 1, 1])  # touches the first again
    cache.allocate(2)  # one free block + one eviction: the least recently used, [2, ...]
    assert cache.evictions == 1
    assert cache.match(hashes([2, 2, 2, 2])) == []
    assert len(cache.match(hashes([1, 1, 1, 1]))) == 1
    assert len(cache.match(hashes([3, 3, 3, 3]))) == 1


def test_inserting_a_known_hash_keeps_the_first_block() -> None:
    cache = PrefixCache(BlockAllocator(8))
    a = cache.allocate(1)
    b = cache.allocate(1)
    cache.insert(hashes([7] * 4), a)
    cache.insert(hashes([7] * 4), b)  # the same prefix computed twice in one batch
    cache.release(a + b)
    assert list(cache.blocks.values()) == a and cache.allocator.num_free == 7


def test_a_table_reuses_the_cached_prefix_then_takes_fresh_blocks() -> None:
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    first = cache.allocate(2)
    cache.insert([b"a", b"b"], first)
    cache.release(first)
    table, reused = cache.table([b"a", b"x"], 3)
    assert (table[:1], reused, len(table)) == (first[:1], 1, 3)
    cache.release(table)
    with pytest.raises(OutOfBlocks):
        cache.table([b"a"], 5)
    assert cache.num_available == 4 and allocator.ref_count(first[0]) == 1  # nothing taken


def test_beyond_its_share_of_the_pool_the_cache_lets_idle_blocks_go_oldest_first() -> None:
    allocator = BlockAllocator(8)
    cache = PrefixCache(allocator, share=0.25)  # two blocks
    older, newer = cache.allocate(2), cache.allocate(2)
    cache.insert([b"a", b"b"], older)
    cache.release(older)
    cache.insert([b"c", b"d"], newer)  # four known, two idle: the idle ones go
    assert list(cache.blocks) == [b"c", b"d"] and cache.evictions == 2
    live = cache.allocate(2)
    cache.insert([b"e", b"f"], live)  # c and d still in use: nothing is idle, all stay
    assert list(cache.blocks) == [b"c", b"d", b"e", b"f"]
    cache.release(newer)
    cache.insert([b"e"], live)  # c and d idle now: they go, e and f (in use) stay
    assert set(cache.blocks) == {b"e", b"f"}
    assert allocator.num_free == 6 and all(allocator.ref_count(b) == 2 for b in live)
