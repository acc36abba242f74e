"""RingAllocator: regions handed out in order, freed from the head, reclaimed when leases run out.
Pure bookkeeping, so `now` is passed in and no test waits."""

from __future__ import annotations

import pytest

from kvtransfer.ring import ALIGN, RingAllocator

LEASE_S = 10.0


def ring(capacity: int = 1024) -> RingAllocator:
    return RingAllocator(capacity, LEASE_S)


def offsets(allocator: RingAllocator) -> list[tuple[int, int]]:
    """(offset, size) of each region still held, from the head."""
    return [(region.offset, region.size) for region in allocator.live]


def allocated(allocator: RingAllocator, size: int, now: float = 0.0) -> tuple[int, int]:
    got = allocator.allocate(size, now)
    assert got is not None, f"{size} bytes did not fit in {offsets(allocator)}"
    return got


def test_regions_are_handed_out_in_order_with_new_tickets() -> None:
    allocator = ring()
    got = [allocated(allocator, 128) for _ in range(4)]
    assert [offset for offset, _ in got] == [0, 128, 256, 384]
    assert len({ticket for _, ticket in got}) == 4
    assert allocator.in_use == 4 and allocator.expired == 0


@pytest.mark.parametrize(("size", "aligned"), [(1, 64), (63, 64), (64, 64), (65, 128), (200, 256)])
def test_sizes_are_aligned_to_64(size: int, aligned: int) -> None:
    allocator = ring()
    allocated(allocator, size)
    offset, _ = allocated(allocator, 1)
    assert ALIGN == 64 and offset == aligned
    assert all(offset % ALIGN == 0 for offset, _ in offsets(allocator))


def test_a_full_ring_returns_none_and_an_exact_fit_fits() -> None:
    allocator = ring()
    allocated(allocator, 1024)
    assert allocator.allocate(1, 0.0) is None
    allocator = ring()
    allocated(allocator, 1000)  # 1024 with alignment
    assert allocator.allocate(1, 0.0) is None
    assert allocator.in_use == 1


def test_a_region_larger_than_the_ring_never_fits() -> None:
    allocator = ring()
    assert allocator.allocate(1025, 0.0) is None
    assert allocator.in_use == 0
    allocated(allocator, 1024)  # the failed attempt took nothing


def test_allocation_wraps_to_the_start_once_the_head_is_free() -> None:
    allocator = ring()
    first, second, third = (allocated(allocator, 320) for _ in range(3))  # 960 of 1024
    assert allocator.allocate(128, 0.0) is None  # 64 left at the end, the start is held
    assert allocator.release(first[1])
    assert allocated(allocator, 128)[0] == 0  # wrapped: the end is too small
    assert offsets(allocator) == [(320, 320), (640, 320), (0, 128)]
    assert allocated(allocator, 192)[0] == 128  # right after the wrapped region, up to the head
    assert allocator.allocate(1, 0.0) is None  # 0..320 used, and the head is at 320
    assert allocator.release(second[1]) and allocator.release(third[1])
    assert offsets(allocator) == [(0, 128), (128, 192)]
    assert allocated(allocator, 704)[0] == 320  # unwrapped again: the end is free to 1024


def test_an_out_of_order_release_frees_nothing_until_the_head_is_released() -> None:
    allocator = ring()
    first, second, _ = (allocated(allocator, 320) for _ in range(3))
    assert allocator.release(second[1])
    assert allocator.in_use == 2
    assert offsets(allocator) == [(0, 320), (320, 320), (640, 320)]  # still held: behind the head
    assert allocator.allocate(128, 0.0) is None
    assert allocator.release(first[1])
    assert offsets(allocator) == [(640, 320)]  # the head and the released one behind it
    assert allocated(allocator, 640)[0] == 0


def test_a_ticket_is_released_once() -> None:
    allocator = ring()
    _, ticket = allocated(allocator, 64)
    assert allocator.release(ticket)
    assert not allocator.release(ticket)
    assert not allocator.release(12345)  # never handed out
    assert allocator.in_use == 0


def test_expired_leases_are_reclaimed_and_counted() -> None:
    allocator = ring()
    allocated(allocator, 512, now=0.0)
    allocated(allocator, 512, now=1.0)
    assert allocator.allocate(512, now=LEASE_S - 0.001) is None  # not yet
    offset, _ = allocated(allocator, 512, now=LEASE_S)  # the first lease ran out
    assert offset == 0 and allocator.expired == 1
    assert offsets(allocator) == [(512, 512), (0, 512)]
    offset, _ = allocated(allocator, 512, now=LEASE_S + 1.0)
    assert offset == 512 and allocator.expired == 2
    assert allocator.in_use == 2


def test_an_expired_lease_behind_a_live_head_frees_nothing_yet() -> None:
    allocator = ring()
    allocated(allocator, 512, now=5.0)
    allocated(allocator, 512, now=0.0)  # expires first, but lies behind the head
    assert allocator.allocate(64, now=LEASE_S) is None
    assert allocator.expired == 1 and allocator.in_use == 1


def test_releasing_an_expired_ticket_does_not_free_the_region_reusing_its_offset() -> None:
    allocator = ring()
    old_offset, old_ticket = allocated(allocator, 1024, now=0.0)
    new_offset, new_ticket = allocated(allocator, 1024, now=LEASE_S)  # reclaimed, reused
    assert new_offset == old_offset and new_ticket != old_ticket
    assert not allocator.release(old_ticket)  # a late release from the receiver that stalled
    assert allocator.in_use == 1
    assert allocator.allocate(64, now=LEASE_S) is None  # the new region is still held
    assert allocator.release(new_ticket)
    assert allocated(allocator, 64, now=LEASE_S)[0] == 0


def test_tickets_are_never_reused() -> None:
    allocator = ring(128)
    tickets = []
    for _ in range(50):
        _, ticket = allocated(allocator, 100)
        tickets.append(ticket)
        assert allocator.release(ticket)
    assert len(set(tickets)) == 50


def test_an_empty_region_never_leads_to_overlapping_regions() -> None:
    allocator = ring()
    first, _ = allocated(allocator, 512), allocated(allocator, 512)
    assert allocator.release(first[1])
    allocated(allocator, 512)  # wrapped: the ring is full, its tail meets its head at 512
    allocator.allocate(0, 0.0)  # a chunk of no bytes
    got = allocator.allocate(64, 0.0)
    held = offsets(allocator)
    assert got is None, f"handed out {got} while holding {held}"
