"""CPU pinning from config: "0", "2-3", "0,2-3"; empty means no pinning. `python -m core.cpus
share-out CPUS COUNT` prints the CPUs of each of COUNT workers pinned within CPUs (launch.sh)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
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


def format_cpus(cpus: Iterable[int]) -> str:
    """The spec naming `cpus`, ranges joined: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def share_out(pool: list[int], count: int) -> list[list[int]]:
    """The CPUs of each of `count` workers pinned within `pool`: fewer workers than CPUs get
    slices of it, as even as can be, so that none of the pool is left idle; more share them,
    one CPU each, round robin."""
    assert pool and count > 0
    if count >= len(pool):
        return [[pool[i % len(pool)]] for i in range(count)]
    return [pool[i * len(pool) // count:(i + 1) * len(pool) // count] for i in range(count)]


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


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "share-out" or not argv[2].isdigit() or argv[2] == "0":
        print("usage: python -m core.cpus share-out CPUS COUNT", file=sys.stderr)
        return 2
    try:
        pool = sorted(parse_cpus(argv[1]))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not pool:
        print("share-out: no CPUs to share", file=sys.stderr)
        return 2
    for cpus in share_out(pool, int(argv[2])):
        print(format_cpus(cpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
