"""Routing: the workers a request goes to (conditional disaggregation), packing onto workers
that share CPUs, and a chat's next turn following its history or pulling it."""

from __future__ import annotations

import pytest

from core.config import Role, Routing
from core.messages import Heartbeat, PullTotals, Register
from engine.kv.block_hash import block_hashes
from gateway.packing import Packing
from gateway.registry import Registry
from gateway.routing import LocalPrefill, Pulling, Router
from tests.gateway.conftest import FP, heartbeat, picked, placed, register, registry


def test_pick_prefill_by_fewest_held_tokens() -> None:
    reg = registry()
    router = Router(reg)
    assert router.pick_prefill() is None
    for worker_id in ("p1", "p2", "p3"):
        reg.register(register(worker_id))
    reg.register(register("d1", "decode"))
    reg.workers["p1"].active.update(a=100)
    reg.workers["p2"].active.update(b=30, c=20)
    reg.workers["p3"].active.update(d=70)
    assert picked(router.pick_prefill()) == "p2"  # 50 tokens, though it holds the most requests
    reg.workers["p2"].active["e"] = 21
    assert picked(router.pick_prefill()) == "p3"  # 71 against 70
    reg.workers["p3"].active.clear()
    assert picked(router.pick_prefill()) == "p3"


def test_pick_prefill_ties_go_to_the_fewest_active() -> None:
    reg = registry()
    router = Router(reg)
    for worker_id in ("p1", "p2", "p3"):
        reg.register(register(worker_id))
    reg.workers["p1"].active.update(a=10, b=10)
    reg.workers["p2"].active.update(c=20)
    reg.workers["p3"].active.update(d=5, e=5, f=10)
    assert picked(router.pick_prefill()) == "p2"


def test_pick_prefill_ignores_heartbeat_load() -> None:
    reg = registry()
    router = Router(reg)
    reg.register(register("p1"))
    reg.register(register("p2"))
    reg.heartbeat(heartbeat("p1", queued=0, running=0))
    reg.heartbeat(heartbeat("p2", queued=10_000, running=50))
    reg.workers["p1"].active["a"] = 1
    assert picked(router.pick_prefill()) == "p2"


def test_pick_decode_by_most_free_capacity() -> None:
    reg = registry()
    router = Router(reg)
    assert router.pick_decode() is None
    reg.register(register("p1"))
    reg.register(register("d1", "decode", num_blocks=10))  # 160 tokens
    reg.register(register("d2", "decode", num_blocks=100))  # 1600
    reg.register(register("d3", "decode", num_blocks=40))  # 640
    assert picked(router.pick_decode()) == "d2"
    reg.workers["d2"].active.update(a=900, b=100)  # 600 free
    assert picked(router.pick_decode()) == "d3"
    reg.workers["d3"].active["c"] = 41  # 599 free
    assert picked(router.pick_decode()) == "d2"
    reg.workers["d2"].active.clear()
    reg.workers["d3"].active.clear()
    reg.workers["d1"].active["x"] = 1
    assert picked(router.pick_decode()) == "d2"


def test_pick_decode_ignores_heartbeat_load() -> None:
    reg = registry()
    router = Router(reg)
    reg.register(register("d1", "decode"))
    reg.register(register("d2", "decode"))
    reg.heartbeat(heartbeat("d1", free=100, running=0))
    reg.heartbeat(heartbeat("d2", free=0, running=90))
    reg.workers["d1"].active["a"] = 16
    assert picked(router.pick_decode()) == "d2"


def test_pick_decode_ties_go_to_the_fewest_active() -> None:
    reg = registry()
    router = Router(reg)
    for worker_id in ("d1", "d2", "d3"):
        reg.register(register(worker_id, "decode"))
    reg.workers["d1"].active.update(a=10, b=10, c=10)
    reg.workers["d2"].active.update(d=30)
    reg.workers["d3"].active.update(e=15, f=15)
    assert picked(router.pick_decode()) == "d2"


def test_pick_decode_before_any_heartbeat_uses_the_registered_size() -> None:
    reg = registry()
    router = Router(reg)
    reg.register(register("d1", "decode", num_blocks=10))
    reg.register(register("d2", "decode", num_blocks=20))
    assert picked(router.pick_decode()) == "d2"


def test_removed_workers_are_not_picked() -> None:
    reg = registry()
    router = Router(reg)
    reg.register(register("p1"))
    assert reg.remove("p1") is not None and reg.remove("p1") is None
    assert router.pick_prefill() is None


def conditional(max_tokens: int = 8, saturated_tokens: int = 100) -> Router:
    router = Router(Registry(FP, 3.0, 1, 1), local=LocalPrefill(max_tokens, saturated_tokens))
    roles: tuple[tuple[str, Role], ...] = (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    for worker_id, role in roles:
        router.registry.register(register(worker_id, role, num_blocks=10))  # 160 tokens each
    return router


def route_path(router: Router, prompt_len: int) -> tuple[str, str, str]:
    route = router.route(list(range(prompt_len)))
    assert route is not None
    return route.prefill.worker_id, route.decode.worker_id, route.path


def test_route_sends_short_prompts_to_the_decode_worker_itself() -> None:
    router = conditional(max_tokens=8)
    assert route_path(router, 8) == ("d1", "d1", "local_short")
    assert route_path(router, 9) == ("p1", "d1", "disaggregated")
    assert router.decisions == {"local_short": 1, "disaggregated": 1}


def test_route_prefills_on_decode_only_when_every_prefill_worker_is_saturated() -> None:
    router = conditional(saturated_tokens=100)
    reg = router.registry
    reg.workers["p1"].active["a"] = 100
    assert route_path(router, 50) == ("p2", "d1", "disaggregated")  # p2 is idle
    reg.workers["p2"].active["b"] = 120
    assert route_path(router, 50) == ("d1", "d1", "local_saturated")
    reg.workers["d1"].active["c"] = 81  # over half of decode's 160 tokens: no headroom
    assert route_path(router, 50)[2] == "disaggregated"
    reg.workers["d1"].active["c"] = 10
    reg.heartbeat(heartbeat("d1", queued=30))  # a prompt of its own still to prefill
    assert route_path(router, 50)[2] == "disaggregated"


def test_a_long_prompt_waits_for_a_saturated_prefill_pool() -> None:
    router = conditional(saturated_tokens=100)
    reg = router.registry
    router.local = LocalPrefill(8, 100, saturated_max_tokens=64)
    reg.workers["p1"].active["a"] = reg.workers["p2"].active["b"] = 500
    assert route_path(router, 64)[2] == "local_saturated"
    assert route_path(router, 65) == ("p1", "d1", "disaggregated")


def test_route_with_saturation_off_never_goes_local_for_long_prompts() -> None:
    router = conditional(max_tokens=0, saturated_tokens=0)
    reg = router.registry
    reg.workers["p1"].active["a"] = reg.workers["p2"].active["b"] = 10**6
    assert route_path(router, 1)[2] == "disaggregated"


def test_route_without_a_prefill_pool_prefills_on_decode() -> None:
    reg = Registry(FP, 3.0, 0, 2)  # colocated
    router = Router(reg)
    assert router.route([1, 2, 3]) is None
    reg.register(register("d1", "decode"))
    reg.register(register("d2", "decode"))
    reg.workers["d1"].active["x"] = 5
    assert route_path(router, 3) == ("d2", "d2", "local_no_prefill")
    assert reg.ready() and reg.capacity_tokens() == 1600


# Workers sharing CPUs: packing (gateway/packing.py)

def packing_router(decode: Routing = "pack", prefill: Routing = "pack",
                   kv_fraction: float = 0.9) -> Router:
    return Router(Registry(FP, 30.0, 0, 0), local=LocalPrefill(0, 0),
                  packing=Packing(decode, prefill, kv_fraction))


def dispatch(router: Router, count: int, prompt_len: int = 10) -> list[tuple[str, str]]:
    """Route `count` prompts, no two alike, and hold them where they went, as the dispatcher
    does: the (prefill, decode) worker of each."""
    went = []
    for _ in range(count):
        request_id = f"r{router.decisions.total()}"
        start = router.decisions.total() * prompt_len
        route = router.route(list(range(start, start + prompt_len)))
        assert route is not None
        for worker in {route.prefill.worker_id: route.prefill,
                       route.decode.worker_id: route.decode}.values():
            worker.active[request_id] = prompt_len
        went.append((route.prefill.worker_id, route.decode.worker_id))
    return went


def decode_counts(reg: Registry) -> dict[str, int]:
    return {w.worker_id: len(w.active) for w in reg.alive("decode")}


def test_decode_workers_on_one_cpu_fill_one_batch_before_the_next() -> None:
    """launch.sh --prefill 2 --decode 6 on two cores: six decode workers on CPU 1."""
    router = packing_router()
    reg = router.registry
    for i in range(6):
        reg.register(placed(f"decode-{i}", max_running=4))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(router, 6)
    assert decode_counts(reg) == {"decode-0": 4, "decode-1": 2, "decode-2": 0, "decode-3": 0,
                                  "decode-4": 0, "decode-5": 0}
    reg.workers["decode-0"].active.pop(next(iter(reg.workers["decode-0"].active)))
    assert dispatch(router, 1) == [("prefill-0", "decode-0")]  # back to the fullest with room


def test_spread_routing_balances_free_kv_whatever_the_cpus() -> None:
    router = packing_router(decode="spread")
    reg = router.registry
    for i in range(6):
        reg.register(placed(f"decode-{i}", max_running=4))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(router, 6)
    assert set(decode_counts(reg).values()) == {1}


def test_packing_balances_free_kv_across_cpus_and_packs_on_each() -> None:
    router = packing_router()
    reg = router.registry
    for i in range(4):
        reg.register(placed(f"decode-{i}", cpus=(2 + i % 2,), max_running=8))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(router, 6)
    assert decode_counts(reg) == {"decode-0": 3, "decode-1": 3, "decode-2": 0, "decode-3": 0}


def test_a_packed_worker_spills_when_its_kv_would_be_too_full() -> None:
    router = packing_router(kv_fraction=0.5)  # 800 of each worker's 1,600 tokens
    reg = router.registry
    for i in range(2):
        reg.register(placed(f"decode-{i}", max_running=64))
    reg.register(placed("prefill-0", "prefill", cpus=(0,), num_blocks=1000))
    dispatch(router, 2, prompt_len=400)
    assert decode_counts(reg) == {"decode-0": 2, "decode-1": 0}
    reg.workers["decode-0"].active["r0"] += 1  # a token more: 801 would not be 800
    assert dispatch(router, 1, prompt_len=400)[0][1] == "decode-1"


def test_a_packed_worker_stalled_unreachable_or_gone_is_passed_over() -> None:
    router = packing_router()
    reg = router.registry
    for i in range(3):
        reg.register(placed(f"decode-{i}"))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(router, 1)
    reg.workers["decode-0"].stalled = True
    assert dispatch(router, 1)[0][1] == "decode-1"
    reg.workers["decode-1"].unreachable = True
    assert dispatch(router, 1)[0][1] == "decode-2"
    reg.remove("decode-2")
    assert dispatch(router, 1)[0][1] == "decode-1"  # unreachable is a last resort, not refused


def test_packing_never_refuses_a_request_when_every_worker_is_full() -> None:
    router = packing_router()
    reg = router.registry
    for i in range(2):
        reg.register(placed(f"decode-{i}", max_running=2))
    reg.register(placed("prefill-0", "prefill", cpus=(0,)))
    dispatch(router, 4)
    reg.workers["decode-1"].active["extra"] = 50  # full too, and less KV free
    assert decode_counts(reg) == {"decode-0": 2, "decode-1": 3}
    assert dispatch(router, 1)[0][1] == "decode-0"  # the most free KV, as spread routes


def test_unpinned_workers_pack_onto_as_many_as_the_cpus_run_at_once() -> None:
    router = packing_router()
    reg = router.registry
    for i in range(4):
        reg.register(placed(f"decode-{i}", cpus=(0, 1), max_running=8))
    reg.register(placed("prefill-0", "prefill", cpus=()))  # CPUs not known: alone
    dispatch(router, 6)
    assert decode_counts(reg) == {"decode-0": 3, "decode-1": 3, "decode-2": 0, "decode-3": 0}


def test_prefill_workers_on_one_cpu_count_as_one_and_prompts_go_to_the_busiest() -> None:
    router = packing_router()
    reg = router.registry
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    assert [p for p, _ in dispatch(router, 3)] == ["prefill-0"] * 3
    reg.register(placed("prefill-2", "prefill", cpus=(2,)))
    # 30 tokens wait on CPU 0, none on CPU 2
    assert [p for p, _ in dispatch(router, 4)] == [
        "prefill-2", "prefill-2", "prefill-2", "prefill-0"]


def test_a_packed_prefill_worker_spills_when_its_kv_is_full() -> None:
    router = packing_router()
    reg = router.registry
    reg.register(placed("decode-0", cpus=(1,), max_running=64, num_blocks=1000))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,), num_blocks=10))  # 160 tokens
    assert [p for p, _ in dispatch(router, 3, prompt_len=80)] == [
        "prefill-0", "prefill-0", "prefill-1"]


def test_a_cached_prefix_wins_over_packing_prefill() -> None:
    router = packing_router()
    reg = router.registry
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    shared = list(range(100, 164))  # four blocks
    reg.workers["prefill-1"].prefixes.add(block_hashes(shared, 16, ""))
    reg.workers["prefill-0"].active["busy"] = 40
    picked_one = router.pick_prefill([*shared, 1, 2])
    assert picked_one is not None and picked_one.worker_id == "prefill-1"


def test_spread_prefill_routing_counts_each_worker_alone() -> None:
    router = packing_router(prefill="spread")
    reg = router.registry
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    assert [p for p, _ in dispatch(router, 4)] == ["prefill-0", "prefill-1"] * 2


def test_prefill_workers_sharing_a_cpu_are_saturated_together() -> None:
    router = Router(Registry(FP, 30.0, 0, 0), local=LocalPrefill(0, 100),
                    packing=Packing("pack", "pack", 0.9))
    reg = router.registry
    reg.register(placed("decode-0", cpus=(1,), max_running=64))
    for i in range(2):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,)))
    reg.workers["prefill-0"].active["a"] = 100  # prefill-1 idle, but on the same, busy core
    assert route_path(router, 50)[2] == "local_saturated"
    router.packing = Packing("pack", "spread", 0.9)
    assert route_path(router, 50)[2] == "disaggregated"


def test_prefill_ties_go_by_id_not_by_registration_order() -> None:
    router = packing_router()
    reg = router.registry
    reg.register(placed("decode-0", cpus=(1,)))
    for worker_id in ("prefill-1", "prefill-0"):  # the second started registers first
        reg.register(placed(worker_id, "prefill", cpus=(0,)))
    assert {prefill for prefill, _ in dispatch(router, 3)} == {"prefill-0"}


# A chat's next turn: to the decode worker holding its history (`local_cached`)

HISTORY = list(range(1000, 1400))  # 25 blocks: an earlier turn's prompt and answer
TURN = [*HISTORY, *range(5000, 5040)]  # the next turn: the history, then a new message
# SmolLM2-135M in fp32: 30 layers of K and V, 3 KV heads of 64. Pulling HISTORY's 400 tokens
# (18 MB at the assumed 500 MB/s) costs 37 ms, as long as 37 tokens at the assumed 1 ms each.
KV_BYTES = 30 * 2 * 3 * 64 * 4
PULLS = Pulling()  # as shipped


def chat_router(decode: int = 2, prefill: int = 1, pulling: Pulling = PULLS) -> Router:
    reg = Registry(FP, 30.0, 0, 0)
    for i in range(decode):
        reg.register(placed(f"decode-{i}", cpus=(i + 1,), max_running=4, num_blocks=1000,
                            kv_bytes_per_token=KV_BYTES))
    for i in range(prefill):
        reg.register(placed(f"prefill-{i}", "prefill", cpus=(0,), num_blocks=1000,
                            kv_bytes_per_token=KV_BYTES))
    return Router(reg, local=LocalPrefill(0, 0), packing=Packing("spread", "spread", 0.9),
                  pulling=pulling)


def test_a_follow_up_turn_goes_to_the_decode_worker_that_finished_its_history() -> None:
    router = chat_router()
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    route = router.route(TURN)
    assert route is not None and route.path == "local_cached"
    assert route.prefill.worker_id == route.decode.worker_id == "decode-1"
    assert router.decisions["local_cached"] == 1
    other = router.route([*range(9000, 9440)])  # a new chat: disaggregated as before
    assert other is not None and other.path == "disaggregated"


def test_a_follow_up_turn_of_another_tenant_finds_nothing_cached() -> None:
    router = chat_router()
    reg = router.registry
    reg.finished("decode-1", HISTORY, "tenant-a")
    route = router.route(TURN, "tenant-b")
    assert route is not None and route.path == "disaggregated"
    mine = router.route(TURN, "tenant-a")
    assert mine is not None and mine.path == "local_cached"


def test_a_holder_with_a_full_batch_or_kv_leaves_the_turn_to_a_prefill_worker() -> None:
    router = chat_router(pulling=Pulling(mode="never"))
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    holder = reg.workers["decode-1"]
    holder.active.update({f"r{i}": 10 for i in range(4)})  # max_running 4: its batch is full
    route = router.route(TURN)
    assert route is not None and route.path == "disaggregated"
    holder.active.clear()
    holder.active["long"] = 15_000  # 16,000 tokens of KV, 90 % of which may be packed
    route = router.route(TURN)
    assert route is not None and route.path == "disaggregated"


def test_a_busy_holder_lends_its_history_to_a_decode_worker_with_room() -> None:
    router = chat_router()
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})  # a full batch
    route = router.route(TURN)
    assert route is not None and route.path == "local_cached"
    assert route.decode.worker_id == "decode-0" and route.pull is not None
    assert route.pull.source.worker_id == "decode-1" and route.pull.tokens == 400
    assert router.pulls["decode"] == 1


def test_a_busy_prefill_worker_lends_its_cached_prompt_to_decode() -> None:
    router = chat_router()
    reg = router.registry
    prefill = reg.workers["prefill-0"]
    prefill.prefixes.add(block_hashes(HISTORY, 16, ""))
    prefill.active["queued"] = 3000  # prompt tokens ahead of this one there
    route = router.route(TURN)
    assert route is not None and route.path == "local_cached" and route.pull is not None
    assert route.pull.source is prefill and router.pulls["prefill"] == 1
    prefill.active.clear()  # idle: it computes the 40 new tokens itself, and hands all over
    route = router.route(TURN)
    assert route is not None and route.path == "disaggregated" and route.pull is None


def test_a_prefix_slower_to_send_than_to_compute_is_computed() -> None:
    router = chat_router(pulling=Pulling(bytes_per_s=1e6))  # 1 MB/s
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})
    route = router.route(TURN)  # 18 MB at 1 MB/s against 400 tokens at 1 ms
    assert route is not None and route.pull is None and route.path == "disaggregated"
    always = chat_router(prefill=0, pulling=Pulling(mode="always", bytes_per_s=1e6))
    always.registry.finished("decode-1", HISTORY, "")
    always.registry.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})
    route = always.route(TURN)
    assert route is not None and route.pull is not None and route.path == "local_cached"


def test_spread_history_routing_sends_a_turn_away_from_its_history() -> None:
    router = chat_router(prefill=0, pulling=Pulling(history="spread"))
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    route = router.route(TURN)
    assert route is not None and route.decode.worker_id == "decode-0"
    assert route.path == "local_cached" and route.pull is not None
    router.pulling = Pulling(history="spread", mode="never")
    route = router.route(TURN)  # computed in full
    assert route is not None and route.decode.worker_id == "decode-0"
    assert route.path == "local_no_prefill" and route.pull is None


def test_a_prefill_worker_holding_more_of_the_prompt_is_less_work() -> None:
    router = chat_router()
    reg = router.registry
    reg.finished("decode-1", HISTORY[:64], "")  # four blocks
    reg.workers["prefill-0"].prefixes.add(block_hashes(HISTORY, 16, ""))
    route = router.route(TURN)
    assert route is not None and route.path == "disaggregated"
    assert route.prefill.worker_id == "prefill-0"


@pytest.mark.parametrize("pulls", [False, True])
def test_the_holder_queue_counts_against_it(pulls: bool) -> None:
    router = chat_router(pulling=Pulling(mode="auto" if pulls else "never"))
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    assert reg.heartbeat(Heartbeat("decode-1", "i0", queued_tokens=2000, free_blocks=1000,
                                   running=1, waiting=0))
    route = router.route(TURN)
    assert route is not None
    if pulls:  # 40 tokens and a pull on decode-0, against 2,040 tokens on decode-1
        assert route.path == "local_cached" and route.pull is not None
        assert route.decode.worker_id == "decode-0"
    else:
        assert route.path == "disaggregated"


def test_colocated_workers_route_a_follow_up_to_the_holder_not_the_emptiest() -> None:
    router = chat_router(decode=2, prefill=0)
    reg = router.registry
    reg.finished("decode-0", HISTORY, "")
    reg.workers["decode-0"].active["busy"] = 300  # decode-1 has more free KV
    route = router.route(TURN)
    assert route is not None and route.path == "local_cached"
    assert route.decode.worker_id == "decode-0"
    fresh = router.route([*range(9000, 9440)])
    assert fresh is not None and fresh.path == "local_no_prefill"
    assert fresh.decode.worker_id == "decode-1"


def test_a_decode_worker_without_prefix_caching_holds_nothing() -> None:
    router = chat_router()
    reg = router.registry
    reg.register(Register("decode-1", "i0", "decode", "", FP, 16, 1000, "a", cpus=[2],
                          threads=1, max_running=4, prefix_caching=False))
    reg.finished("decode-1", HISTORY, "")
    route = router.route(TURN)
    assert route is not None and route.path == "disaggregated"


def test_spread_avoids_the_history_not_a_system_prompt_every_worker_holds() -> None:
    router = chat_router(decode=3, prefill=0, pulling=Pulling(history="spread"))
    reg = router.registry
    reg.finished("decode-0", HISTORY[:32], "")  # two blocks every chat starts with
    reg.finished("decode-2", HISTORY[:32], "")
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-0"].active["busy"] = 100  # decode-2 has the most free KV
    route = router.route(TURN)
    assert route is not None and route.decode.worker_id == "decode-2"
    assert route.pull is not None and route.pull.source.worker_id == "decode-1"


def test_a_worker_whose_pulls_were_slow_computes_instead() -> None:
    router = chat_router()
    reg = router.registry
    reg.finished("decode-1", HISTORY, "")
    reg.workers["decode-1"].active.update({f"r{i}": 10 for i in range(4)})  # a full batch
    slow = PullTotals(pulls=4, seconds=2.0)  # half a second each: 500 tokens at 1 ms
    assert reg.heartbeat(Heartbeat("decode-0", "i0", 0, 1000, 1, 0, pulls=slow))
    route = router.route(TURN)
    assert route is not None and route.pull is None and route.path == "disaggregated"


def test_the_gateway_expects_no_more_cached_than_a_workers_cache_keeps() -> None:
    router = chat_router(pulling=Pulling(mode="never"))
    reg = router.registry
    reg.register(Register("decode-1", "i1", "decode", "", FP, 16, 1000, "a", cpus=[2],
                          threads=1, max_running=4, prefix_caching=True, cache_blocks=10))
    assert reg.workers["decode-1"].prefixes.capacity == 10
    reg.finished("decode-1", HISTORY, "")  # 25 blocks: the first 15 are gone from its cache
    route = router.route(TURN)
    assert route is not None and route.path == "disaggregated"
