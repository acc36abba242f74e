"""Worker membership: layout check, re-registration, heartbeats, expiry, stalls, draining,
readiness and health, membership events. Where a test says a worker is not routed to, a
`Router` over the registry checks it (routing itself: test_routing.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import cast

import pytest

from core.config import Role
from core.messages import Alive, Heartbeat, Register
from gateway.registry import Registry
from gateway.routing import Router
from tests.gateway.conftest import FP, heartbeat, picked, placed, register, registry


def test_matching_worker_is_admitted() -> None:
    reg = registry()
    reply, previous = reg.register(register("d1", "decode", kv_address="tcp://127.0.0.1:9"))
    assert reply.accepted and previous is None
    info = reg.workers["d1"]
    assert (info.role, info.kv_address, info.block_size, info.num_blocks) == (
        "decode", "tcp://127.0.0.1:9", 16, 100)
    assert info.capacity_tokens == 1600 and info.held_tokens == 0 and info.active == {}
    assert info.load is None


def test_fingerprint_mismatch_is_refused_naming_both() -> None:
    reg = registry()
    other = "smollm2|bfloat16|30|3|64|16"
    reply, previous = reg.register(register("p1", fingerprint=other))
    assert not reply.accepted and previous is None
    assert other in reply.reason and FP in reply.reason and "mismatch" in reply.reason
    assert "p1" not in reg.workers and reg.refused == 1


def test_unknown_role_is_refused() -> None:
    """The codec refuses such a Register on the wire; made in-process, the registry does."""
    reg = registry()
    reply, _ = reg.register(register("x1", role=cast(Role, "embed")))
    assert not reply.accepted and "embed" in reply.reason and not reg.workers


def test_reregistration_replaces_and_returns_the_previous() -> None:
    reg = registry()
    reg.register(register("p1", instance="old"))
    first = reg.workers["p1"]
    reply, previous = reg.register(register("p1", instance="new"))
    assert reply.accepted and previous is first
    assert reg.workers["p1"].instance_id == "new" and len(reg.workers) == 1


def test_refused_reregistration_keeps_the_registered_worker() -> None:
    reg = registry()
    reg.register(register("p1", instance="old"))
    reply, _ = reg.register(register("p1", instance="new", fingerprint="other"))
    assert not reply.accepted and reg.workers["p1"].instance_id == "old"


def test_heartbeat_records_load_and_nothing_else() -> None:
    reg = registry()
    reg.register(register("p1"))
    info = reg.workers["p1"]
    info.active["r1"] = 30
    info.last_seen -= 5.0
    before = time.monotonic()
    beat = heartbeat("p1", queued=42, free=3, running=7)
    assert reg.heartbeat(beat)
    assert info.load == beat and info.last_seen >= before
    assert info.active == {"r1": 30} and info.held_tokens == 30  # routing state untouched
    assert info.capacity_tokens == 1600 and info.num_blocks == 100


def test_heartbeat_from_a_stale_instance_is_ignored() -> None:
    reg = registry()
    reg.register(register("p1", instance="old"))
    reg.register(register("p1", instance="new"))
    assert not reg.heartbeat(heartbeat("p1", instance="old", queued=999))
    assert reg.workers["p1"].load is None


def test_heartbeat_from_an_unknown_worker_is_ignored() -> None:
    reg = registry()
    assert not reg.heartbeat(heartbeat("ghost"))
    assert not reg.workers


def test_expire_after_the_timeout() -> None:
    reg = registry(timeout_s=0.2)
    reg.register(register("p1"))
    reg.register(register("d1", "decode"))
    assert reg.expire() == []
    reg.workers["p1"].last_seen -= 1.0  # its last sign of life was a second ago
    dead = reg.expire()
    assert [w.worker_id for w in dead] == ["p1"] and list(reg.workers) == ["d1"]
    assert reg.expire() == []
    time.sleep(0.25)  # and in real time
    assert [w.worker_id for w in reg.expire()] == ["d1"] and not reg.workers


def test_heartbeats_keep_a_worker_alive() -> None:
    reg = registry(timeout_s=0.5)
    reg.register(register("p1"))
    reg.workers["p1"].last_seen -= 1.0
    assert reg.heartbeat(heartbeat("p1"))
    assert reg.expire() == []


def test_stale_heartbeats_do_not_keep_a_worker_alive() -> None:
    reg = registry(timeout_s=0.5)
    reg.register(register("p1", instance="new"))
    reg.workers["p1"].last_seen -= 1.0
    assert not reg.heartbeat(heartbeat("p1", instance="old"))
    assert [w.worker_id for w in reg.expire()] == ["p1"]


def test_ready_by_expected_counts() -> None:
    reg = registry(prefill=2, decode=1)
    assert not reg.ready()
    reg.register(register("p1"))
    reg.register(register("d1", "decode"))
    assert not reg.ready()
    reg.register(register("p1", instance="again"))  # the same worker again does not count twice
    assert not reg.ready()
    reg.register(register("p2"))
    assert reg.ready()
    reg.remove("d1")
    assert not reg.ready()
    assert not registry(prefill=0, decode=0).ready()  # no decode worker: nothing is served


def test_health_tells_starting_from_degraded_from_unavailable() -> None:
    reg = registry(prefill=1, decode=2)
    reg.register(register("p1"))
    reg.register(register("d1", "decode"))
    assert reg.health() == "starting"  # never whole yet, though d1 could serve
    reg.register(register("d2", "decode"))
    assert reg.health() == "ok"
    reg.remove("d2")
    assert reg.health() == "degraded"  # d1 still serves
    reg.remove("p1")
    assert reg.health() == "degraded"  # d1 prefills prompts itself
    reg.remove("d1")
    assert reg.health() == "unavailable"
    for worker in (register("p1"), register("d1", "decode"), register("d2", "decode")):
        reg.register(worker)
    assert reg.health() == "ok"


def test_alive_by_role() -> None:
    reg = registry()
    roles: tuple[tuple[str, Role], ...] = (("p1", "prefill"), ("d1", "decode"), ("p2", "prefill"))
    for worker_id, role in roles:
        reg.register(register(worker_id, role))
    assert [w.worker_id for w in reg.alive("prefill")] == ["p1", "p2"]
    assert [w.worker_id for w in reg.alive("decode")] == ["d1"]


def test_held_tokens_sum_the_active_requests() -> None:
    reg = registry()
    reg.register(register("d1", "decode", num_blocks=10))
    info = reg.workers["d1"]
    assert info.capacity_tokens == 160 and info.held_tokens == 0
    info.active.update(a=5, b=20)
    assert info.held_tokens == 25
    info.active["a"] += 1
    del info.active["b"]
    assert info.held_tokens == 6


def test_capacity_tokens_is_none_until_a_decode_worker_registers() -> None:
    reg = registry()
    assert reg.capacity_tokens() is None
    reg.register(register("p1", num_blocks=50))
    assert reg.capacity_tokens() is None
    reg.register(register("d1", "decode", num_blocks=100))
    assert reg.capacity_tokens() == 50 * 16
    reg.remove("p1")
    assert reg.capacity_tokens() == 100 * 16  # decode prefills for itself now
    reg.remove("d1")
    assert reg.capacity_tokens() is None


def test_capacity_tokens_is_the_smallest_live_worker() -> None:
    reg = registry()
    reg.register(register("p1", num_blocks=200))
    reg.register(register("p2", num_blocks=80))
    reg.register(register("d1", "decode", num_blocks=300))
    reg.register(register("d2", "decode", num_blocks=90))
    assert reg.capacity_tokens() == 80 * 16  # a prefill worker is the smallest
    reg.remove("p2")
    assert reg.capacity_tokens() == 90 * 16  # now a decode worker
    reg.workers["d2"].active["a"] = 500  # what is held does not shrink it
    assert reg.capacity_tokens() == 90 * 16
    reg.register(register("d2", "decode", instance="new", num_blocks=10))
    assert reg.capacity_tokens() == 10 * 16  # the re-registered size counts
    reg.workers["d2"].last_seen -= 10.0
    assert [w.worker_id for w in reg.expire()] == ["d2"]
    assert reg.capacity_tokens() == 200 * 16


def test_reregistration_by_the_same_instance_keeps_its_requests() -> None:
    reg = registry()
    reg.register(register("d1", "decode", num_blocks=10))
    reg.workers["d1"].active.update(a=5, b=7)
    reply, previous = reg.register(register("d1", "decode", num_blocks=20))
    assert reply.accepted and previous is not None and previous.active == {"a": 5, "b": 7}
    info = reg.workers["d1"]
    assert info.active == {"a": 5, "b": 7} and info.held_tokens == 12
    assert info.num_blocks == 20
    info.active.pop("a")  # what the dispatcher releases is released for the registered worker
    assert reg.workers["d1"].held_tokens == 7


def test_reregistration_by_a_new_instance_starts_empty() -> None:
    reg = registry()
    reg.register(register("d1", "decode"))
    reg.workers["d1"].active.update(a=5)
    reply, previous = reg.register(register("d1", "decode", instance="i1"))
    assert reply.accepted and previous is not None and previous.active == {"a": 5}
    assert reg.workers["d1"].active == {} and reg.workers["d1"].held_tokens == 0


def beat(reg: Registry, worker_id: str, progress: int, running: int = 0,
         waiting: int = 0) -> None:
    assert reg.heartbeat(Heartbeat(worker_id, "i0", 0, 100, running, waiting,
                                   progress=progress))


def stall_registry(stall_timeout_s: float) -> Registry:
    reg = Registry(FP, 30.0, 1, 1, stall_timeout_s)
    reg.register(register("p1"))
    reg.register(register("d1", "decode"))
    return reg


def test_a_worker_with_work_and_no_progress_stalls_after_the_timeout() -> None:
    reg = stall_registry(0.2)
    beat(reg, "p1", progress=10, waiting=2)
    beat(reg, "d1", progress=10, running=1)
    assert reg.newly_stalled() == []
    time.sleep(0.25)
    beat(reg, "p1", progress=11, waiting=2)  # moving: fine
    beat(reg, "d1", progress=10, running=1)
    assert [w.worker_id for w in reg.newly_stalled()] == ["d1"]
    assert reg.newly_stalled() == []  # reported once
    assert Router(reg).pick_decode() is None and not reg.ready()
    assert reg.health() == "unavailable"
    assert [w.worker_id for w in reg.alive("decode")] == ["d1"]  # still a member


def test_an_idle_worker_never_stalls() -> None:
    reg = stall_registry(0.1)
    beat(reg, "d1", progress=5)
    beat(reg, "p1", progress=0)
    time.sleep(0.15)
    beat(reg, "d1", progress=5)
    beat(reg, "p1", progress=0)
    assert reg.newly_stalled() == [] and reg.ready()


def test_a_loop_silent_for_the_stall_timeout_stalls_though_alive() -> None:
    """Its Alive beats go on (a thread of its own) while its loop sends no heartbeat: wedged
    in a step. It is alive, not routed to, and serves again once it reports with no work."""
    reg = stall_registry(0.2)
    beat(reg, "d1", progress=5)
    for _ in range(3):
        time.sleep(0.1)
        assert reg.beat(Alive("d1", "i0")) and reg.beat(Alive("p1", "i0"))
        beat(reg, "p1", progress=0)
    assert [w.worker_id for w in reg.newly_stalled()] == ["d1"]
    assert reg.expire() == [] and Router(reg).pick_decode() is None
    beat(reg, "d1", progress=5)
    assert not reg.workers["d1"].stalled and picked(Router(reg).pick_decode()) == "d1"


def test_alive_beats_keep_a_worker_alive_and_only_its_own_instance() -> None:
    reg = Registry(FP, 0.2, 1, 1)
    reg.register(register("d1", "decode"))
    for _ in range(4):
        time.sleep(0.1)
        assert reg.beat(Alive("d1", "i0"))
        assert reg.expire() == []
    assert not reg.beat(Alive("d1", "another")) and not reg.beat(Alive("d9", "i0"))
    time.sleep(0.25)
    assert [w.worker_id for w in reg.expire()] == ["d1"]


def test_only_progress_clears_a_stall() -> None:
    reg = stall_registry(0.0)
    beat(reg, "d1", progress=5, running=1)
    assert "d1" in [w.worker_id for w in reg.newly_stalled()]  # p1, silent, too
    beat(reg, "d1", progress=5)  # its requests were moved away: idle, yet not progressing
    assert reg.workers["d1"].stalled and Router(reg).pick_decode() is None
    beat(reg, "d1", progress=6, running=1)
    assert not reg.workers["d1"].stalled and picked(Router(reg).pick_decode()) == "d1"


def events(reg: Registry) -> list[tuple[str, str]]:
    return [(event.kind, event.worker_id) for event in reg.events]


def test_membership_events_follow_joins_restarts_stalls_and_deaths() -> None:
    reg = Registry(FP, 0.2, 1, 1, 0.0)
    reg.register(Register("p1", "i0", "prefill", "", FP, 16, 100, "host-a"))
    reg.register(register("d1", "decode"))
    reg.register(register("d1", "decode"))  # the same process again: not news
    reg.register(register("d1", "decode", instance="i1"))
    reg.register(register("x1", fingerprint="other"))
    assert reg.heartbeat(Heartbeat("d1", "i1", 0, 100, 1, 0, progress=5))
    # p1's loop has never reported: under a zero stall timeout, that is a stall too.
    assert [w.worker_id for w in reg.newly_stalled()] == ["p1", "d1"]
    assert reg.heartbeat(Heartbeat("d1", "i1", 0, 100, 1, 0, progress=6))
    assert reg.remove("p1") is not None and reg.remove("p1") is None
    time.sleep(0.25)
    assert [w.worker_id for w in reg.expire()] == ["d1"]
    assert events(reg) == [("registered", "p1"), ("registered", "d1"), ("restarted", "d1"),
                           ("refused", "x1"), ("stalled", "p1"), ("stalled", "d1"),
                           ("recovered", "d1"),
                           ("left", "p1"), ("dead", "d1")]
    first = reg.events[0]
    assert (first.role, first.host) == ("prefill", "host-a") and first.at <= time.time()


def test_only_the_newest_membership_events_are_kept() -> None:
    reg = registry()
    for n in range(300):
        reg.register(register(f"p{n}"))
    assert len(reg.events) == 200 and reg.events[-1].worker_id == "p299"


def test_the_registry_keeps_where_each_worker_computes() -> None:
    reg = Registry(FP, 30.0, 0, 0)
    reg.register(placed("d1", cpus=(2, 3), threads=2, max_running=48, host="host-b"))
    info = reg.workers["d1"]
    assert (info.cpus, info.threads, info.max_running, info.host) == ((2, 3), 2, 48, "host-b")


def test_a_draining_worker_gets_no_new_work_and_shrinks_the_pool() -> None:
    reg = registry(prefill=1, decode=2)
    for worker_id in ("d1", "d2"):
        reg.register(register(worker_id, "decode"))
    reg.register(register("p1"))
    assert reg.health() == "ok"
    reg.heartbeat(Heartbeat("d2", "i0", 0, 100, 0, 0, draining=True))
    assert reg.workers["d2"].draining
    assert [w.worker_id for w in reg.serving("decode")] == ["d1"]
    router = Router(reg)
    assert {picked(router.pick_decode()) for _ in range(5)} == {"d1"}
    assert reg.expected["decode"] == 1 and reg.health() == "ok"  # it goes on purpose
    reg.remove("d2")
    assert reg.expected["decode"] == 1 and reg.health() == "ok"
    assert [(e.kind, e.worker_id, e.detail) for e in reg.events][-2:] == [
        ("draining", "d2", "it said so"), ("left", "d2", "drained")]


def test_a_worker_that_leaves_without_draining_is_still_expected() -> None:
    reg = registry(prefill=1, decode=2)
    for worker_id in ("d1", "d2"):
        reg.register(register(worker_id, "decode"))
    reg.register(register("p1"))
    reg.remove("d2")
    assert reg.expected["decode"] == 2 and reg.health() == "degraded"


def test_no_decode_worker_is_never_ready_whatever_is_expected() -> None:
    reg = registry(prefill=0, decode=0)
    assert not reg.ready() and reg.health() == "starting"
    reg.register(register("d1", "decode"))
    assert reg.health() == "ok"
    reg.drain(reg.workers["d1"], "asked")
    assert reg.health() == "unavailable" and Router(reg).pick_decode() is None


def test_held_tokens_follow_every_way_requests_come_and_go() -> None:
    reg = registry()
    reg.register(register("d1", "decode", num_blocks=10))
    active = reg.workers["d1"].active
    active.update({"a": 5, "b": 7}, c=1)
    active["b"] = 3
    assert active.pop("a") == 5 and active.pop("gone", None) is None
    assert reg.workers["d1"].held_tokens == 4 == sum(active.values())
    active.clear()
    assert reg.workers["d1"].held_tokens == 0


def test_heartbeats_read_late_count_from_when_they_were_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway reading its messages seconds late (starved of CPU) must not count heartbeats
    sent before a request reached the worker as sent after it: their worker's clock says when
    (its least lag to ours, from its first heartbeat, converts it)."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    reg = registry()
    reg.register(register("p1"))
    worker = reg.workers["p1"]

    def sent(at: float, read: float) -> None:
        now[0] = read
        reg.heartbeat(replace(heartbeat("p1"), sent_at=at))

    sent(100.0, read=1000.0)  # the worker's clock runs 900 s behind ours
    dispatched = 1000.2
    sent(100.1, read=1003.0)
    sent(100.15, read=1003.1)  # both sent before the request left: read late
    assert not worker.reported_twice_since(dispatched)
    sent(100.7, read=1003.2)
    assert not worker.reported_twice_since(dispatched)  # one sent since: it may not list it
    sent(101.2, read=1003.3)
    assert worker.reported_twice_since(dispatched)
