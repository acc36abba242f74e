"""Workers grouped by the CPUs they share, and the ones packing sends new work to."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.packing import Unit, alone, pack, packed, units


@dataclass
class Worker:
    worker_id: str
    cpus: tuple[int, ...] = (1,)
    host: str = "a"
    threads: int = 1
    held_tokens: int = 0
    running: int = 0


def ids(found: list[Unit[Worker]]) -> list[list[str]]:
    return [[w.worker_id for w in unit.workers] for unit in found]


def test_workers_on_the_same_cpus_of_one_host_are_one_unit() -> None:
    workers = [Worker("d0"), Worker("d1", cpus=(2,)), Worker("d2"), Worker("d3", host="b"),
               Worker("d4", cpus=(2,))]
    found = units(workers)
    assert ids(found) == [["d0", "d2"], ["d1", "d4"], ["d3"]]
    assert [unit.slots for unit in found] == [1, 1, 1]


def test_workers_whose_cpus_are_not_known_are_alone() -> None:
    assert ids(units([Worker("d0", cpus=()), Worker("d1", cpus=())])) == [["d0"], ["d1"]]


def test_a_unit_runs_as_many_workers_at_once_as_its_cpus_have_room_for_their_threads() -> None:
    four = (0, 1, 2, 3)
    found = units([Worker(f"d{i}", cpus=four, threads=2) for i in range(3)])
    assert ids(found) == [["d0", "d1", "d2"]] and found[0].slots == 2
    # as many workers as the CPUs run at once: none waits for another, each is alone
    assert ids(units([Worker(f"d{i}", cpus=four) for i in range(4)])) == [
        ["d0"], ["d1"], ["d2"], ["d3"]]
    # threads not known count as one; more threads than CPUs still run one worker
    assert units([Worker("d0", cpus=(0, 1), threads=0), Worker("d1", cpus=(0, 1))]) == [
        Unit((Worker("d0", cpus=(0, 1), threads=0),), 1), Unit((Worker("d1", cpus=(0, 1)),), 1)]
    assert units([Worker("d0", threads=4), Worker("d2", threads=4)])[0].slots == 1


def test_a_unit_holds_what_its_workers_hold() -> None:
    (unit,) = units([Worker("p0", held_tokens=300), Worker("p1", held_tokens=50)])
    assert unit.held_tokens == 350


def test_alone_makes_a_unit_of_each_worker() -> None:
    assert ids(alone([Worker("d0"), Worker("d1")])) == [["d0"], ["d1"]]


def test_packed_takes_the_busiest_with_room_in_each_unit() -> None:
    workers = [Worker("d0", running=64), Worker("d1", running=3), Worker("d2"),
               Worker("d3", cpus=(2,)), Worker("d4", cpus=(2,), running=1)]

    def room(w: Worker) -> bool:
        return w.running < 64

    def load(w: Worker) -> int:
        return w.running

    assert [w.worker_id for w in packed(units(workers), room, load)] == ["d1", "d4"]
    workers[1].running = 64
    assert [w.worker_id for w in packed(units(workers), room, load)] == ["d2", "d4"]
    workers[0].running = 63  # the busiest gets its room back: it is filled again first
    assert [w.worker_id for w in packed(units(workers), room, load)] == ["d0", "d4"]


def test_packed_breaks_ties_by_id_and_fills_every_slot() -> None:
    workers = [Worker(f"d{i}", cpus=(0, 1)) for i in (3, 1, 2)]
    assert [w.worker_id for w in packed(units(workers), lambda w: True, lambda w: 0)] == [
        "d1", "d2"]


def test_packed_is_empty_when_none_has_room() -> None:
    assert packed(units([Worker("d0"), Worker("d1")]), lambda w: False, lambda w: 0) == []


def test_pack_lets_workers_of_unknown_cpus_take_work_alone() -> None:
    workers = [Worker("g0", cpus=(), running=64), Worker("g1", cpus=()), Worker("d0"),
               Worker("d1", running=2)]

    def room(w: Worker) -> bool:
        return w.running < 64

    def load(w: Worker) -> int:
        return w.running

    assert [w.worker_id for w in pack(workers, room, load)] == ["g1", "d1"]
    assert [w.worker_id for w in pack(workers[:2], room, load)] == ["g1"]
    assert sorted(w.worker_id for w in pack(workers, room, load)) == sorted(
        w.worker_id for w in packed(units(workers), room, load))
