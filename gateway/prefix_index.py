"""Which prompt prefixes each prefill worker probably has cached, as the gateway routed them.

An approximation kept by the gateway alone (workers report nothing about their caches): the
block hashes of every prompt sent to a worker, least recently used dropped beyond the worker's
block count, as its own cache drops them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.hashes: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes

    def matched(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (by hash) were sent to this worker before."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[bytes]) -> None:
        """A prompt with these block hashes is being sent to this worker."""
        for block_hash in hashes:
            self.hashes[block_hash] = None
            self.hashes.move_to_end(block_hash)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)
