"""CPU pinning from config: "0", "2-3", "0,2-3"; empty means no pinning."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def parse_cpus(spec: str) -> set[int]:
    """The CPU ids a spec names; ValueError for anything malformed."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"bad CPU list {spec!r}: expected e.g. 0,2-3")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"bad CPU range {part!r} in {spec!r}")
        cpus.update(range(low, high + 1))
    return cpus


def pin_to(spec: str) -> None:
    """Run this process on the CPUs `spec` names (no-op when it is empty)."""
    cpus = parse_cpus(spec)
    if not cpus:
        return
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise ValueError(f"CPUs {sorted(cpus - available)} are not available here")
    os.sched_setaffinity(0, cpus)


def pinned_cpus() -> list[int]:
    """The CPUs this process may run on, lowest first: its pinning, or every CPU it has."""
    return sorted(os.sched_getaffinity(0))


@contextmanager
def running_on(spec: str) -> Iterator[None]:
    """The block runs on the CPUs `spec` names (all of them where it is empty); after it, the
    process runs where it ran before."""
    before = os.sched_getaffinity(0)
    pin_to(spec)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
