"""Worker membership: layout check, re-registration, heartbeats, expiry, readiness, routing
(packing onto workers that share CPUs included)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import cast

import pytest

from core.config import Role, Routing
from core.messages import Alive, Heartbeat, PullTotals, Register
from engine.kv.block_hash import block_hashes
from gateway.packing import Packing
from gateway.registry import LocalPrefill, Pulling, Registry, WorkerInfo

FP = "smollm2|float32|30|3|64|16"


def registry(timeout_s: float = 3.0, prefill: int = 1, decode: int = 1) -> Registry:
    return Registry(FP, timeout_s, prefill, decode)


def register(worker_id: str, role: Role = "prefill", instance: str = "i0", fingerprint: str = FP,
             num_blocks: int = 100, kv_address: str = "") -> Register:
    return Register(worker_id, instance, role, kv_address, fingerprint, 16, num_blocks,
                    prefix_caching=True)


def heartbeat(worker_id: str, instance: str = "i0", queued: int = 0, free: int = 100,
              running: int = 0) -> Heartbeat:
    return Heartbeat(worker_id, instance, queued, free, running, 0)


def picked(worker: WorkerInfo | None) -> str | None:
    return None if worker is None else worker.worker_id


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


def test_pick_prefill_by_fewest_held_tokens() -> None:
    reg = registry()
    assert reg.pick_prefill() is None
    for worker_id in ("p1", "p2", "p3"):
        reg.register(register(worker_id))
    reg.register(register("d1", "decode"))
    reg.workers["p1"].active.update(a=100)
    reg.workers["p2"].active.update(b=30, c=20)
    reg.workers["p3"].active.update(d=70)
    assert picked(reg.pick_prefill()) == "p2"  # 50 tokens, though it holds the most requests
    reg.workers["p2"].active["e"] = 21
    assert picked(reg.pick_prefill()) == "p3"  # 71 against 70
    reg.workers["p3"].active.clear()
    assert picked(reg.pick_prefill()) == "p3"


def test_pick_prefill_ties_go_to_the_fewest_active() -> None:
    reg = registry()
    for worker_id in ("p1", "p2", "p3"):
        reg.register(register(worker_id))
    reg.workers["p1"].active.update(a=10, b=10)
    reg.workers["p2"].active.update(c=20)
    reg.workers["p3"].active.update(d=5, e=5, f=10)
    assert picked(reg.pick_prefill()) == "p2"


def test_pick_prefill_ignores_heartbeat_load() -> None:
    reg = registry()
    reg.register(register("p1"))
    reg.register(register("p2"))
    reg.heartbeat(heartbeat("p1", queued=0, running=0))
    reg.heartbeat(heartbeat("p2", queued=10_000, running=50))
    reg.workers["p1"].active["a"] = 1
    assert picked(reg.pick_prefill()) == "p2"


def test_pick_decode_by_most_free_capacity() -> None:
    reg = registry()
    assert reg.pick_decode() is None
    reg.register(register("p1"))
    reg.register(register("d1", "decode", num_blocks=10))  # 160 tokens
    reg.register(register("d2", "decode", num_blocks=100))  # 1600
    reg.register(register("d3", "decode", num_blocks=40))  # 640
    assert picked(reg.pick_decode()) == "d2"
    reg.workers["d2"].active.update(a=900, b=100)  # 600 free
    assert picked(reg.pick_decode()) == "d3"
    reg.workers["d3"].active["c"] = 41  # 599 free
    assert picked(reg.pick_decode()) == "d2"
    reg.workers["d2"].active.clear()
    reg.workers["d3"].active.clear()
    reg.workers["d1"].active["x"] = 1
    assert picked(reg.pick_decode()) == "d2"


def test_pick_decode_ignores_heartbeat_load() -> None:
    reg = registry()
    reg.register(register("d1", "decode"))
    reg.register(register("d2", "decode"))
    reg.heartbeat(heartbeat("d1", free=100, running=0))
    reg.heartbeat(heartbeat("d2", free=0, running=90))
    reg.workers["d1"].active["a"] = 16
    assert picked(reg.pick_decode()) == "d2"


def test_pick_decode_ties_go_to_the_fewest_active() -> None:
    reg = registry()
    for worker_id in ("d1", "d2", "d3"):
        reg.register(register(worker_id, "decode"))
    reg.workers["d1"].active.update(a=10, b=10, c=10)
    reg.workers["d2"].active.update(d=30)
    reg.workers["d3"].active.update(e=15, f=15)
    assert picked(reg.pick_decode()) == "d2"


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


def test_pick_decode_before_any_heartbeat_uses_the_registered_size() -> None:
    reg = registry()
    reg.register(register("d1", "decode", num_blocks=10))
    reg.register(register("d2", "decode", num_blocks=20))
    assert picked(reg.pick_decode()) == "d2"


def test_removed_workers_are_not_picked() -> None:
    reg = registry()
    reg.register(register("p1"))
    assert reg.remove("p1") is not None and reg.remove("p1") is None
    assert reg.pick_prefill() is None


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
    assert reg.pick_decode() is None and not reg.ready()
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
    assert reg.expire() == [] and reg.pick_decode() is None
    beat(reg, "d1", progress=5)
    assert not reg.workers["d1"].stalled and picked(reg.pick_decode()) == "d1"


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
    assert reg.workers["d1"].stalled and reg.pick_decode() is None
    beat(reg, "d1", progress=6, running=1)
    assert not reg.workers["d1"].stalled and picked(reg.pick_decode()) == "d1"


def conditional(max_tokens: int = 8, saturated_tokens: int = 100) -> Registry:
    reg = Registry(FP, 3.0, 1, 1, local=LocalPrefill(max_tokens, saturated_tokens))
    roles: tuple[tuple[str, Role], ...] = (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    for worker_id, role in roles:
        reg.register(register(worker_id, role, num_blocks=10))  # 160 tokens each
    return reg


def route_path(reg: Registry, prompt_len: int) -> tuple[str, str, str]:
    route = reg.route(list(range(prompt_len)))
    assert route is not None
    return route.prefill.worker_id, route.decode.worker_id, route.path


def test_route_sends_short_prompts_to_the_decode_worker_itself() -> None:
    reg = conditional(max_tokens=8)
    assert route_path(reg, 8) == ("d1", "d1", "local_short")
    assert route_path(reg, 9) == ("p1", "d1", "disaggregated")
    assert reg.decisions == {"local_short": 1, "disaggregated": 1}


def test_route_prefills_on_decode_only_when_every_prefill_worker_is_saturated() -> None:
    reg = conditional(saturated_tokens=100)
    reg.workers["p1"].active["a"] = 100
    assert route_path(reg, 50) == ("p2", "d1", "disaggregated")  # p2 is idle
    reg.workers["p2"].active["b"] = 120
    assert route_path(reg, 50) == ("d1", "d1", "local_saturated")
    reg.workers["d1"].active["c"] = 81  # over half of decode's 160 tokens: no headroom
    assert route_path(reg, 50)[2] == "disaggregated"
    reg.workers["d1"].active["c"] = 10
    reg.heartbeat(heartbeat("d1", queued=30))  # a prompt of its own still to prefill
    assert route_path(reg, 50)[2] == "disaggregated"


def test_a_long_prompt_waits_for_a_saturated_prefill_pool() -> None:
    reg = conditional(saturated_tokens=100)
    reg.local = LocalPrefill(8, 100, saturated_max_tokens=64)
    reg.workers["p1"].active["a"] = reg.workers["p2"].active["b"] = 500
    assert route_path(reg, 64)[2] == "local_saturated"
    assert route_path(reg, 65) == ("p1", "d1", "disaggregated")


def test_route_with_saturation_off_never_goes_local_for_long_prompts() -> None:
    reg = conditional(max_tokens=0, saturated_tokens=0)
    reg.workers["p1"].active["a"] = reg.workers["p2"].active["b"] = 10**6
    assert route_path(reg, 1)[2] == "disaggregated"


def test_route_without_a_prefill_pool_prefills_on_decode() -> None:
    reg = Registry(FP, 3.0, 0, 2)  # colocated
    assert reg.route([1, 2, 3]) is None
    reg.register(register("d1", "decode"))
    reg.register(register("d2", "decode"))
    reg.workers["d1"].active["x"] = 5
    assert route_path(reg, 3) == ("d2", "d2", "local_no_prefill")
    assert reg.ready() and reg.capacity_tokens() == 1600


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


# Workers sharing CPUs: packing (gateway/packing.py)

def placed(worker_id: str, role: Role = "decode", cpus: tuple[int, ...] = (1,), threads: int = 1,
           max_running: int = 4, num_blocks: int = 100, host: str = "a",
           kv_bytes_per_token: int = 0) -> Register:
    return Register(worker_id, "i0", role, "", FP, 16, num_blocks, host, cpus=list(cpus),
                    threads=threads, max_running=max_running if role == "decode" else 0,
                    prefix_caching=True, kv_bytes_per_token=kv_bytes_per_token)


def packing_registry(decode: Routing = "pack", prefill: Routing = "pack",
                     kv_fraction: float = 0.9) -> Registry:
    return Registry(FP, 30.0, 0, 0, local=LocalPrefill(0, 0),
                    packing=Packing(decode, prefill, kv_fraction))


def dispatch(reg: Registry, count: int, prompt_len: int = 10) -> list[tuple[str, str]]:
    """Route `count` prompts, no two alike, and hold them where they went, as the dispatcher
    does: the (prefill, decode) worker of each."""
    went = []
    for _ in range(count):
        request_id = f"r{reg.decisions.total()}"
        start = reg.decisions.total() * prompt_len
        route = reg.route(list(range(start, start + prompt_len)))
        assert route is not None
        for worker in {route.prefill.worker_id: route.prefill,
                       route.decode.worker_id: route.decode}.values():
            worker.active[request_id] = prompt_len
        went.append((route.prefill.worker_id, route.decode.worker_id))
    return went


def decode_counts(reg: Registry) -> dict[str, int]:
    return {w.worker_id: len(w.active) for w in reg.alive("decode")}


def test_the_registry_keeps_where_each_worker_computes() -> None:
    reg = packing_registry()
    reg.register(placed("d1", cpus=(2, 3), threads=2, max_running=48, host="host-b"))
    info = reg.workers["d1"]
    assert (info.cpus, info.threads, info.max_running, info.host) == ((2, 3), 2, 48, "host-b")


def test_decode_workers_on_one_cpu_fill_one_batch_before_the_next() -> None:
    """launch.sh --prefill 2 --decode 6 on two cores: six decode workers on CPU 1."""
    reg = packing_registry()
    for i in range(6):
        reg.register(placed(f"decode-{i}", max_running=4))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(reg, 6)
    assert decode_counts(reg) == {"decode-0": 4, "decode-1": 2, "decode-2": 0, "decode-3": 0,
                                  "decode-4": 0, "decode-5": 0}
    reg.workers["decode-0"].active.pop(next(iter(reg.workers["decode-0"].active)))
    assert dispatch(reg, 1) == [("prefill-0", "decode-0")]  # back to the fullest with room


def test_spread_routing_balances_free_kv_whatever_the_cpus() -> None:
    reg = packing_registry(decode="spread")
    for i in range(6):
        reg.register(placed(f"decode-{i}", max_running=4))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(reg, 6)
    assert set(decode_counts(reg).values()) == {1}


def test_packing_balances_free_kv_across_cpus_and_packs_on_each() -> None:
    reg = packing_registry()
    for i in range(4):
        reg.register(placed(f"decode-{i}", cpus=(2 + i % 2,), max_running=8))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(reg, 6)
    assert decode_counts(reg) == {"decode-0": 3, "decode-1": 3, "decode-2": 0, "decode-3": 0}


def test_a_packed_worker_spills_when_its_kv_would_be_too_full() -> None:
    reg = packing_registry(kv_fraction=0.5)  # 800 of each worker's 1,600 tokens
    for i in range(2):
        reg.register(placed(f"decode-{i}", max_running=64))
    reg.register(placed("prefill-0", "prefill", cpus=(0,), num_blocks=1000))
    dispatch(reg, 2, prompt_len=400)
    assert decode_counts(reg) == {"decode-0": 2, "decode-1": 0}
    reg.workers["decode-0"].active["r0"] += 1  # a token more: 801 would not be 800
    assert dispatch(reg, 1, prompt_len=400)[0][1] == "decode-1"


def test_a_packed_worker_stalled_unreachable_or_gone_is_passed_over() -> None:
    reg = packing_registry()
    for i in range(3):
        reg.register(placed(f"decode-{i}"))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(reg, 1)
    reg.workers["decode-0"].stalled = True
    assert dispatch(reg, 1)[0][1] == "decode-1"
    reg.workers["decode-1"].unreachable = True
    assert dispatch(reg, 1)[0][1] == "decode-2"
    reg.remove("decode-2")
    assert dispatch(reg, 1)[0][1] == "decode-1"  # unreachable is a last resort, not refused


def test_packing_never_refuses_a_request_when_every_worker_is_full() -> None:
    reg = packing_registry()
    for i in range(2):
        reg.register(placed(f"decode-{i}", max_running=2))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(reg, 4)
    reg.workers["decode-1"].active["extra"] = 50  # full too, and less KV free
    assert decode_counts(reg) == {"decode-0": 2, "decode-1": 3}
    assert dispatch(reg, 1)[0][1] == "decode-0"  # the most free KV, as spread routes


def test_unpinned_workers_pack_onto_as_many_as_the_cpus_run_at_once() -> None:
    reg = packing_registry()
    for i in range(4):
        reg.register(placed(f"decode-{i}", cpus=(0, 1), max_running=8))
    reg.register(placed("prefill-0", "prefill", cpus=()))  # CPUs not known: alone
    dispatch(reg, 6)
    assert decode_counts(reg) == {"decode-0": 3, "decode-1": 3, "decode-2": 0, "decode-3": 0}


def test_prefill_workers_on_one_cpu_count_as_one_and_prompts_go_to_the_busiest() -> None:
    reg = packing_registry()
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    assert [p for p, _ in dispatch(reg, 3)] == ["prefill-0"] * 3
    reg.register(placed("prefill-2", "prefill", cpus=(2,)))
    # 30 tokens wait on CPU 0, none on CPU 2
    assert [p for p, _ in dispatch(reg, 4)] == ["prefill-2", "prefill-2", "prefill-2", "prefill-0"]


def test_a_packed_prefill_worker_spills_when_its_kv_is_full() -> None:
    reg = packing_registry()
    reg.register(placed("decode-0", cpus=(1,), max_running=64, num_blocks=1000))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,), num_blocks=10))  # 160 tokens
    assert [p for p, _ in dispatch(reg, 3, prompt_len=80)] == [
        "prefill-0", "prefill-0", "prefill-1"]


def test_a_cached_prefix_wins_over_packing_prefill() -> None:
    reg = packing_registry()
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    shared = list(range(100, 164))  # four blocks
    reg.workers["prefill-1"].prefixes.add(block_hashes(shared, 16, ""))
    reg.workers["prefill-0"].active["busy"] = 40
    picked_one = reg.pick_prefill([*shared, 1, 2])
    assert picked_one is not None and picked_one.worker_id == "prefill-1"


def test_spread_prefill_routing_counts_each_worker_alone() -> None:
    reg = packing_registry(prefill="spread")
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    assert [p for p, _ in dispatch(reg, 4)] == ["prefill-0", "prefill-1"] * 2


def test_prefill_workers_sharing_a_cpu_are_saturated_together() -> None:
    reg = Registry(FP, 30.0, 0, 0, local=LocalPrefill(0, 100),
                   packing=Packing("pack", "pack", 0.9))
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    reg.workers["prefill-0"].active["a"] = 100  # prefill-1 idle, but on the same, busy core
    assert route_path(reg, 50)[2] == "local_saturated"
    reg.packing = Packing("pack", "spread", 0.9)
    assert route_path(reg, 50)[2] == "disaggregated"


def test_prefill_ties_go_by_id_not_by_registration_order() -> None:
    reg = packing_registry()
    reg.register(placed("decode-0", cpus=(1,)))
    for worker_id in ("prefill-1", "prefill-0"):  # the second started registers first
        reg.register(placed(worker_id, "prefill", cpus=(0,)))
    assert {prefill for prefill, _ in dispatch(reg, 3)} == {"prefill-0"}


def test_a_draining_worker_gets_no_new_work_and_its_leave_shrinks_the_pool() -> None:
    reg = registry(prefill=1, decode=2)
    for worker_id in ("d1", "d2"):
        reg.register(register(worker_id, "decode"))
    reg.register(register("p1"))
    assert reg.health() == "ok"
    reg.heartbeat(Heartbeat("d2", "i0", 0, 100, 0, 0, draining=True))
    assert reg.workers["d2"].draining
    assert [w.worker_id for w in reg.serving("decode")] == ["d1"]
    assert {picked(reg.pick_decode()) for _ in range(5)} == {"d1"}
    assert reg.health() == "degraded"  # draining: expected back only once it has left
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
    assert reg.health() == "unavailable" and reg.pick_decode() is None


# A chat's next turn: to the decode worker holding its history (`local_cached`)

HISTORY = list(range(1000, 1400))  # 25 blocks: an earlier turn's prompt and answer
TURN = [*HISTORY, *range(5000, 5040)]  # the next turn: the history, then a new message
# SmolLM2-135M in fp32: 30 layers of K and V, 3 KV heads of 64. Pulling HISTORY's 400 tokens
# (18 MB at the assumed 500 MB/s) costs 37 ms, as long as 37 tokens at the assumed 1 ms each.
KV_BYTES = 30 * 2 * 3 * 64 * 4
PULLS = Pulling()  # as shipped


def chat_registry(decode: int = 2, prefill: int = 1, pulling: Pulling = PULLS) -> Registry:
    reg = Registry(FP, 30.0, 0, 0, local=LocalPrefill(0, 0),
                   packing=Packing("spread", "spread", 0.9), pulling=pulling)
    for i in range(decode):
        reg.register(placed(f"decode-{i}", cpus=(i + 1,), max_running=4, num_blocks=1000,
                            kv_bytes_per_token=KV_BYTES))
    for i in range(prefill):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,), num_blocks=1000,
                            kv_bytes_per_token=KV_BYTES))
    return reg


def test_a_follow_up_turn_goes_to_the_decode_worker_that_finished_its_history() -> None:
    reg = chat_registry()
    reg.finished("decode-1", HISTORY, "")
    route = reg.route(TURN)
    assert route is not None and route.path == "local_cached"
    assert route.prefill.worker_id == route.decode.worker_id == "decode-1"
    assert reg.decisions["local_cached"] == 1
    other = reg.route([*range(9000, 9440)])  # a new chat: disaggregated as before
    assert other is not None and other.path == "disaggregated"


def test_a_follow_up_turn_of_another_tenant_finds_nothing_cached() -> None:
    reg = chat_registry()
    reg.finished("decode-1", HISTORY, "tenant-a")
    route = reg.route(TURN, "tenant-b")
    assert route is not None and route.path == "disaggregated"
    mine = reg.route(TURN, "tenant-a")
    assert mine is not None and mine.path == "local_cached"


def test_a_holder_with_a_full_batch_or_kv_leaves_the_turn_to_a_prefill_worker() -> None:
    reg = chat_registry(pulling=Pulling(mode="never"))
    reg.finished("decode-1", HISTORY, "")
    holder = reg.workers["decode-1"]
    holder.active.update({f"r{i}": 10 for i in range(4)})  # max_running 4: its batch is full
    route = reg.route(TURN)
    assert route is not None and route.path == "disaggregated"
    holder.active.clear()
    holder.active["long"] = 15_000  # 16,000 tokens of KV, 90 % of which may be packed
    route = reg.route(TURN)
    assert route is not None and route.path == "disaggregated"


def test_a_busy_holder_lends_its_history_to_a_decode_worker_with_room() -> None:
    reg = chat_registry()
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})  # a full batch
    route = reg.route(TURN)
    assert route is not None and route.path == "local_cached"
    assert route.decode.worker_id == "decode-0" and route.pull is not None
    assert route.pull.source.worker_id == "decode-1" and route.pull.tokens == 400
    assert reg.pulls["decode"] == 1


def test_a_busy_prefill_worker_lends_its_cached_prompt_to_decode() -> None:
    reg = chat_registry()
    prefill = reg.workers["prefill-0"]
    prefill.prefixes.add(block_hashes(HISTORY, 16, ""))
    prefill.active["queued"] = 3000  # prompt tokens ahead of this one there
    route = reg.route(TURN)
    assert route is not None and route.path == "local_cached" and route.pull is not None
    assert route.pull.source is prefill and reg.pulls["prefill"] == 1
    prefill.active.clear()  # idle: it computes the 40 new tokens itself, and hands all over
    route = reg.route(TURN)
    assert route is not None and route.path == "disaggregated" and route.pull is None


def test_a_prefix_slower_to_send_than_to_compute_is_computed() -> None:
    reg = chat_registry(pulling=Pulling(bytes_per_s=1e6))  # 1 MB/s
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})
    route = reg.route(TURN)  # 18 MB at 1 MB/s against 400 tokens at 1 ms
    assert route is not None and route.pull is None and route.path == "disaggregated"
    always = chat_registry(prefill=0, pulling=Pulling(mode="always", bytes_per_s=1e6))
    always.finished("decode-1", HISTORY, "")
    always.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})
    route = always.route(TURN)
    assert route is not None and route.pull is not None and route.path == "local_cached"


def test_spread_history_routing_sends_a_turn_away_from_its_history() -> None:
    reg = chat_registry(prefill=0, pulling=Pulling(history="spread"))
    reg.finished("decode-1", HISTORY, "")
    route = reg.route(TURN)
    assert route is not None and route.decode.worker_id == "decode-0"
    assert route.path == "local_cached" and route.pull is not None
    reg.pulling = Pulling(history="spread", mode="never")
    route = reg.route(TURN)  # computed in full
    assert route is not None and route.decode.worker_id == "decode-0"
    assert route.path == "local_no_prefill" and route.pull is None


def test_a_prefill_worker_holding_more_of_the_prompt_is_less_work() -> None:
    reg = chat_registry()
    reg.finished("decode-1", HISTORY[:64], "")  # four blocks
    reg.workers["prefill-0"].prefixes.add(block_hashes(HISTORY, 16, ""))
    route = reg.route(TURN)
    assert route is not None and route.path == "disaggregated"
    assert route.prefill.worker_id == "prefill-0"


@pytest.mark.parametrize("pulls", [False, True])
def test_the_holder_queue_counts_against_it(pulls: bool) -> None:
    reg = chat_registry(pulling=Pulling(mode="auto" if pulls else "never"))
    reg.finished("decode-1", HISTORY, "")
    assert reg.heartbeat(Heartbeat("decode-1", "i0", queued_tokens=2000, free_blocks=1000,
                                   running=1, waiting=0))
    route = reg.route(TURN)
    assert route is not None
    if pulls:  # 40 tokens and a pull on decode-0, against 2,040 tokens on decode-1
        assert route.path == "local_cached" and route.pull is not None
        assert route.decode.worker_id == "decode-0"
    else:
        assert route.path == "disaggregated"


def test_colocated_workers_route_a_follow_up_to_the_holder_not_the_emptiest() -> None:
    reg = chat_registry(decode=2, prefill=0)
    reg.finished("decode-0", HISTORY, "")
    reg.workers["decode-0"].active["busy"] = 300  # decode-1 has more free KV
    route = reg.route(TURN)
    assert route is not None and route.path == "local_cached"
    assert route.decode.worker_id == "decode-0"
    fresh = reg.route([*range(9000, 9440)])
    assert fresh is not None and fresh.path == "local_no_prefill"
    assert fresh.decode.worker_id == "decode-1"


def test_a_decode_worker_without_prefix_caching_holds_nothing() -> None:
    reg = chat_registry()
    reg.register(Register("decode-1", "i0", "decode", "", FP, 16, 1000, "a", cpus=[2],
                          threads=1, max_running=4, prefix_caching=False))
    reg.finished("decode-1", HISTORY, "")
    route = reg.route(TURN)
    assert route is not None and route.path == "disaggregated"


def test_spread_avoids_the_history_not_a_system_prompt_every_worker_holds() -> None:
    reg = chat_registry(decode=3, prefill=0, pulling=Pulling(history="spread"))
    reg.finished("decode-0", HISTORY[:32], "")  # two blocks every chat starts with
    reg.finished("decode-2", HISTORY[:32], "")
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-0"].active["busy"] = 100  # decode-2 has the most free KV
    route = reg.route(TURN)
    assert route is not None and route.decode.worker_id == "decode-2"
    assert route.pull is not None and route.pull.source.worker_id == "decode-1"


def test_a_worker_whose_pulls_were_slow_computes_instead() -> None:
    reg = chat_registry()
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})  # a full batch
    slow = PullTotals(pulls=4, seconds=2.0)  # half a second each: 500 tokens at 1 ms
    assert reg.heartbeat(Heartbeat("decode-0", "i0", 0, 1000, 1, 0, pulls=slow))
    route = reg.route(TURN)
    assert route is not None and route.pull is None and route.path == "disaggregated"


def test_the_gateway_expects_no_more_cached_than_a_workers_cache_keeps() -> None:
    reg = chat_registry(pulling=Pulling(mode="never"))
    reg.register(Register("decode-1", "i1", "decode", "", FP, 16, 1000, "a", cpus=[2],
                          threads=1, max_running=4, prefix_caching=True, cache_blocks=10))
    assert reg.workers["decode-1"].prefixes.capacity == 10
    reg.finished("decode-1", HISTORY, "")  # 25 blocks: the first 15 are gone from its cache
    route = reg.route(TURN)
    assert route is not None and route.path == "disaggregated"


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
