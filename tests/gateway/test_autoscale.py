"""The pools' wanted sizes: from queued prompt tokens, KV use, batch occupancy and latency
against the SLOs; growing at once, shrinking one worker at a time after a while."""

from __future__ import annotations

from core.config import AutoscaleConfig, Role
from core.messages import Heartbeat, Register
from gateway.autoscale import Autoscaler
from gateway.recent import RecentLatency
from gateway.registry import Registry

FP = "fp"
CONFIG = AutoscaleConfig(ttft_slo_ms=1000, tpot_slo_ms=100, prefill_queue_tokens=1000,
                         decode_kv_fraction=0.5, decode_batch_fraction=0.5, scale_down_s=30)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cluster(prefill: int, decode: int) -> tuple[Autoscaler, Registry, RecentLatency, Clock]:
    clock = Clock()
    registry = Registry(FP, 30.0, 1, 1)
    for i in range(prefill):
        registry.register(Register(f"p{i}", "i", "prefill", "", FP, 16, 100))
    for i in range(decode):
        registry.register(Register(f"d{i}", "i", "decode", "tcp://127.0.0.1:9", FP, 16, 100,
                                   max_running=8))
    recent = RecentLatency(clock=clock)
    return Autoscaler(CONFIG, registry, recent, clock), registry, recent, clock


def hold(registry: Registry, worker_id: str, requests: int, tokens: int) -> None:
    registry.workers[worker_id].active.update(
        {f"{worker_id}-r{i}": tokens for i in range(requests)})


def use_blocks(registry: Registry, worker_id: str, used: int) -> None:
    registry.heartbeat(Heartbeat(worker_id, "i", 0, 100 - used, 0, 0))


def test_an_idle_cluster_wants_one_worker_a_pool() -> None:
    scaler, *_ = cluster(2, 3)
    assert [scaler.desired(r) for r in ("prefill", "decode")] == [2, 3]  # not at once: later
    scaler.clock.now += 31  # type: ignore[attr-defined]
    assert [scaler.desired(r) for r in ("prefill", "decode")] == [1, 2]


def test_queued_prompt_tokens_ask_for_prefill_workers_at_once() -> None:
    scaler, registry, _, _ = cluster(1, 1)
    hold(registry, "p0", 5, 700)  # 3,500 tokens waiting, 1,000 a worker
    assert scaler.desired("prefill") == 4


def test_kv_use_and_full_batches_ask_for_decode_workers() -> None:
    scaler, registry, _, _ = cluster(1, 2)
    use_blocks(registry, "d0", 90)
    use_blocks(registry, "d1", 70)  # 160 of 200 blocks; 50 a worker at most
    assert scaler.desired("decode") == 4
    use_blocks(registry, "d0", 0)
    use_blocks(registry, "d1", 0)
    hold(registry, "d0", 8, 10)
    hold(registry, "d1", 7, 10)  # 15 sequences, 4 a worker at most
    assert scaler.desired("decode") == 4


def test_a_missed_slo_asks_for_one_more_worker_and_stops_any_shrinking() -> None:
    scaler, _, recent, clock = cluster(2, 1)
    assert scaler.desired("prefill") == 2  # wants 1, waits
    recent.ttft(1.5)  # over the 1 s SLO
    assert scaler.desired("prefill") == 3
    recent.tpot(0.2)
    assert scaler.desired("decode") == 2
    clock.now += 61  # the slow samples age out of the last minute
    assert scaler.desired("prefill") == 2  # a lower wish starts its wait afresh
    clock.now += 31
    assert scaler.desired("prefill") == 1


def test_a_pool_shrinks_one_worker_at_a_time_and_only_after_wanting_fewer_throughout() -> None:
    scaler, registry, _, clock = cluster(1, 4)
    assert scaler.desired("decode") == 4
    clock.now += 20
    hold(registry, "d0", 16, 10)  # busy enough for all four again: the wait starts over
    assert scaler.desired("decode") == 4
    registry.workers["d0"].active.clear()
    assert scaler.desired("decode") == 4
    clock.now += 29
    assert scaler.desired("decode") == 4
    clock.now += 2
    assert scaler.desired("decode") == 3  # one at a time
    assert scaler.desired("decode") == 3  # the same to every reader until it is made
    clock.now += 40
    assert scaler.desired("decode") == 3  # and no further step before it is
    registry.remove("d3")
    assert scaler.desired("decode") == 3
    clock.now += 31
    assert scaler.desired("decode") == 2


def test_no_prefill_pool_wants_none_unless_one_is_expected() -> None:
    role: Role = "prefill"
    scaler, registry, _, _ = cluster(0, 1)
    assert scaler.desired(role) == 1  # expected 1
    registry.expected["prefill"] = 0
    assert scaler.desired(role) == 0
