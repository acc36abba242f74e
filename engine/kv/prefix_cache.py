"""The prefix cache: full KV blocks kept after their request ends, found again by block hash.

Pure bookkeeping over a `BlockAllocator`. The cache holds one reference on each block it
knows; a request that reuses a block takes another. A block only the cache holds is idle and
is evicted, least recently used first, when an allocation needs room, or when the cache knows
more blocks than its share of the pool (`share`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.kv.allocator import BlockAllocator, OutOfBlocks


def capacity(num_blocks: int, share: float) -> int:
    """The most blocks a cache keeps that may hold `share` of a pool of `num_blocks`."""
    assert 0 < share <= 1
    return max(1, int(num_blocks * share))


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, share: float = 1.0) -> None:
        self.allocator = allocator
        self.max_blocks = capacity(allocator.num_total, share)
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> block, LRU first
        self.hits = 0  # blocks reused, since start
        self.evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus idle cached ones."""
        return self.allocator.num_free + self._idle_count()

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each with a reference taken
        for the caller (give them back with `release`)."""
        found: list[int] = []
        for block_hash in hashes:
            block = self.blocks.get(block_hash)
            if block is None:
                break
            self.blocks.move_to_end(block_hash)
            found.append(block)
        self.allocator.incref(found)
        self.hits += len(found)
        return found

    def table(self, hashes: Sequence[bytes], num_blocks: int) -> tuple[list[int], int]:
        """A block table of `num_blocks` blocks, and how many of them were cached: those of
        the longest prefix of `hashes` (referenced for the caller), then fresh ones. Raises
        OutOfBlocks (changing nothing) when there is no room for the rest."""
        reused = self.match(hashes)
        try:
            return reused + self.allocate(num_blocks - len(reused)), len(reused)
        except OutOfBlocks:
            self.release(reused)
            raise

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, evicting idle cached blocks (least recently used first) as
        needed; raises OutOfBlocks (changing nothing) when even that is not enough."""
        if n > self.num_available:
            raise OutOfBlocks(f"need {n} blocks, {self.num_available} available")
        while self.allocator.num_free < n:
            evicted = self._evict_one()
            assert evicted, "no idle block to evict, though num_available said there was"
        return self.allocator.allocate(n)

    def insert(self, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Remember that `blocks[i]` holds the KV of the block hashed `hashes[i]` (full blocks
        whose KV is written). A hash already cached keeps its block."""
        assert len(hashes) <= len(blocks)
        for block_hash, block in zip(hashes, blocks, strict=False):
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)
            else:
                self.allocator.incref([block])
                self.blocks[block_hash] = block
        while len(self.blocks) > self.max_blocks and self._evict_one():
            pass

    def release(self, blocks: Sequence[int]) -> None:
        """Give back a request's references (cached blocks stay, now idle unless shared)."""
        self.allocator.free(list(blocks))

    def _idle_count(self) -> int:
        return sum(self.allocator.ref_count(b) == 1 for b in self.blocks.values())

    def _evict_one(self) -> bool:
        """Evict the least recently used idle block; False when none is idle."""
        for block_hash, block in self.blocks.items():
            if self.allocator.ref_count(block) == 1:
                del self.blocks[block_hash]
                self.allocator.free([block])
                self.evictions += 1
                return True
        return False
