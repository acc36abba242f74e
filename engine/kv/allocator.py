"""Reference-counted bookkeeping of KV cache blocks (no tensors here)."""

from __future__ import annotations

from collections import Counter


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens at `block_size` tokens per block."""
    if num_tokens < 0 or block_size <= 0:
        raise ValueError(f"bad num_tokens={num_tokens} / block_size={block_size}")
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1; a block is free again when its ref count hits 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._ref_counts = [0] * num_blocks
        # Popped from the end: low ids are handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks not referenced by anyone."""
        return len(self._free)

    @property
    def num_total(self) -> int:
        """All blocks, free or not."""
        return len(self._ref_counts)

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks with ref count 1; raises OutOfBlocks (allocating none) if too few."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add a reference to each (allocated) block, e.g. to share a prefix."""
        for block in blocks:
            assert self._is_allocated(block), f"incref of free block {block}"
        for block in blocks:
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 become free."""
        for block, count in Counter(blocks).items():
            assert self._is_allocated(block, count), f"free of free block {block}"
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        """Current number of references to `block`."""
        return self._ref_counts[block]

    def _is_allocated(self, block: int, references: int = 1) -> bool:
        return 0 <= block < len(self._ref_counts) and self._ref_counts[block] >= references
