"""Workers that take turns on the same CPUs, and packing new work onto as few as those CPUs run.

Each worker reports at registration the CPUs it may run on, its threads and (decode) its batch's
most sequences. Workers of one host pinned to the same CPUs compete for them: six decode workers
on one core, each with a small batch, stream all the weights six times for one core's worth of
tokens, where one worker running the six batches' sequences streams them once. So such workers
form a `Unit` with as many `slots` as its CPUs run workers at once (CPUs // threads): new work
goes to the busiest of them with room, `slots` at a time, and spills to the next only when those
are full. Workers whose CPUs are not known, or whose CPUs have a slot for each, are units of
their own. Pure bookkeeping: `gateway/routing.py` routes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from core.config import Routing


class Placed(Protocol):
    """A worker as packing sees it: where it computes, and how much it holds."""

    worker_id: str
    host: str
    cpus: tuple[int, ...]  # empty: not known
    threads: int  # 0: not known

    @property
    def held_tokens(self) -> int: ...


W = TypeVar("W", bound=Placed)


@dataclass(frozen=True)
class Packing:
    """How the gateway routes over workers sharing CPUs, per pool (`gateway.decode_routing`,
    `gateway.prefill_routing`), and how full a packed worker's KV may get
    (`gateway.pack_kv_fraction`)."""

    decode: Routing = "pack"
    prefill: Routing = "pack"
    kv_fraction: float = 0.9


PACK = Packing()  # the default: both pools packed


@dataclass(frozen=True)
class Unit(Generic[W]):
    """Workers computing on the same CPUs, and how many of them those CPUs run at once."""

    workers: tuple[W, ...]
    slots: int

    def __post_init__(self) -> None:
        assert self.workers and 1 <= self.slots <= len(self.workers)

    @property
    def held_tokens(self) -> int:
        return sum(w.held_tokens for w in self.workers)


def units(workers: Iterable[W]) -> list[Unit[W]]:
    """The workers grouped by the CPUs they share on their host; a group whose CPUs have a
    slot for each of its workers (or whose CPUs are not known) is a unit per worker."""
    groups: dict[tuple[str, tuple[int, ...]], list[W]] = {}
    found: list[Unit[W]] = []
    for worker in workers:
        if worker.cpus:
            groups.setdefault((worker.host, worker.cpus), []).append(worker)
        else:
            found.append(Unit((worker,), 1))
    for group in groups.values():
        slots = _slots(group) if len(group) > 1 else 1
        if slots >= len(group):
            found += [Unit((worker,), 1) for worker in group]
        else:
            found.append(Unit(tuple(group), slots))
    return found


def alone(workers: Iterable[W]) -> list[Unit[W]]:
    """Each worker a unit of its own: how `spread` routing sees them."""
    return [Unit((worker,), 1) for worker in workers]


def _slots(group: Sequence[Placed]) -> int:
    """How many of the group's workers its CPUs run at once (at least one)."""
    threads = max(max(w.threads for w in group), 1)
    return max(len(group[0].cpus) // threads, 1)


def pack(workers: Sequence[W], room: Callable[[W], bool], load: Callable[[W], int]) -> list[W]:
    """`packed(units(workers), ...)`, without a unit for each worker whose CPUs are not known
    (a simulated one, a GPU's): those take work alone, whenever they have room."""
    alone = [w for w in workers if not w.cpus and room(w)]
    shared = [w for w in workers if w.cpus]
    return alone + packed(units(shared), room, load) if shared else alone


def packed(found: Iterable[Unit[W]], room: Callable[[W], bool],
           load: Callable[[W], int]) -> list[W]:
    """The workers new work may go to: in each unit, the busiest (by `load`, then by id) of
    those with `room`, as many as it has slots. Empty when none has room."""
    chosen: list[W] = []
    for unit in found:
        if len(unit.workers) == 1:  # most often (workers on CPUs of their own): no order
            chosen += [w for w in unit.workers if room(w)]
            continue
        open_ = sorted((w for w in unit.workers if room(w)), key=lambda w: (-load(w), w.worker_id))
        chosen += open_[:unit.slots]
    return chosen
