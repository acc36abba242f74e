"""Regions of a staging buffer, handed out in order and reused once released. Pure bookkeeping.

A region is released when its receiver says it copied the chunk out, or reclaimed when its
lease runs out (the receiver died or stalled; a late read of a reused region then fails its
checksum and is dropped, never used).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

ALIGN = 64


@dataclass
class _Region:
    ticket: int
    offset: int
    size: int
    deadline: float
    released: bool = False


class RingAllocator:
    def __init__(self, capacity: int, lease_s: float) -> None:
        assert capacity > 0 and lease_s > 0
        self.capacity = capacity
        self.lease_s = lease_s
        self.live: deque[_Region] = deque()  # in allocation order
        self.by_ticket: dict[int, _Region] = {}
        self.next_ticket = 0
        self.expired = 0  # regions reclaimed because their lease ran out

    def allocate(self, size: int, now: float) -> tuple[int, int] | None:
        """(offset, ticket) of `size` free bytes, or None when they do not fit now."""
        self.reclaim(now)
        size = max(1, -(-size // ALIGN)) * ALIGN  # an empty region would break the ordering
        offset = self._free_offset(size)
        if offset is None:
            return None
        region = _Region(self.next_ticket, offset, size, now + self.lease_s)
        self.next_ticket += 1
        self.live.append(region)
        self.by_ticket[region.ticket] = region
        return offset, region.ticket

    def release(self, ticket: int) -> bool:
        """Free the region of `ticket`; False if it is not live (released, reclaimed, unknown)."""
        region = self.by_ticket.pop(ticket, None)
        if region is None:
            return False
        region.released = True
        self._pop_released()
        return True

    @property
    def in_use(self) -> int:
        return len(self.by_ticket)

    def _free_offset(self, size: int) -> int | None:
        if not self.live:
            return 0 if size <= self.capacity else None
        head = self.live[0].offset
        tail = self.live[-1].offset + self.live[-1].size
        if self.live[-1].offset >= head:  # not wrapped: free space at the end, then the start
            # Going back to the start early reuses memory that is likely still in cache; only
            # when the start has room for half the buffer, so the ring keeps its capacity.
            if head >= max(size, self.capacity // 2):
                return 0
            if self.capacity - tail >= size:
                return tail
            return 0 if head >= size else None
        return tail if head - tail >= size else None

    def reclaim(self, now: float) -> None:
        """Take back every region whose lease has run out by `now`."""
        for region in self.live:
            if not region.released and region.deadline <= now:
                region.released = True
                del self.by_ticket[region.ticket]
                self.expired += 1
        self._pop_released()

    def _pop_released(self) -> None:
        while self.live and self.live[0].released:
            self.live.popleft()
