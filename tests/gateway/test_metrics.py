"""The gateway's /metrics text: KV transfer totals and dropped chunks from the last heartbeats."""

from __future__ import annotations

import time

import yaml
from prometheus_client.parser import text_string_to_metric_families

from core.config import GatewayConfig, Role
from core.messages import DropCount, Heartbeat, Register, TransferTotals
from gateway.metrics import Metrics
from gateway.registry import Registry
from gateway.routing import LocalPrefill, Router
from tests.gateway.dashboard import (
    ROOT,
    dashboard_metrics,
    missing_from,
)

FP = "tiny|float32|layers=2|kv_heads=2|head_dim=16"
SEND = TransferTotals("shm", "send", chunks=60, bytes=3 * 2**30, seconds=1.25, failures=2)
RECEIVE = TransferTotals("any", "receive", chunks=58, bytes=5_000_000, seconds=0.5, failures=0)
DROPS = [DropCount("checksum", 1), DropCount("stale epoch", 3), DropCount("unknown request", 7)]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
KV_SERIES = ("raging_kv_transfer_", "raging_kv_chunks_dropped")


def membership() -> Registry:
    registry = Registry(FP, 3.0, 1, 1)
    roles: tuple[tuple[str, Role], ...] = (("prefill-0", "prefill"), ("decode-0", "decode"),
                                           ("decode-1", "decode"))
    for worker_id, role in roles:
        reply, _ = registry.register(Register(worker_id, "i0", role, "", FP, 16, 100))
        assert reply.accepted
    return registry


def beat(registry: Registry, worker_id: str, transfers: list[TransferTotals],
         dropped: list[DropCount] | None = None) -> None:
    heartbeat = Heartbeat(worker_id, "i0", 0, 90, 1, 0, transfers=transfers,
                          dropped_chunks=dropped or [])
    assert registry.heartbeat(heartbeat)


def samples(text: str) -> Samples:
    """Every sample of the exposition, by name and labels; the KV ones must be counters."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(KV_SERIES):
            assert family.type == "counter", family.name
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in found, f"{key} appears twice"
            found[key] = sample.value
    return found


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset(values.items())


def test_transfer_totals_are_exported_per_worker_backend_and_direction() -> None:
    registry = membership()
    beat(registry, "prefill-0", [SEND])
    beat(registry, "decode-0", [RECEIVE], DROPS)
    text = Metrics().render(registry, Router(registry), 0).decode()
    found = samples(text)
    send = labels(worker="prefill-0", backend="shm", direction="send")
    receive = labels(worker="decode-0", backend="any", direction="receive")
    for field in ("bytes", "seconds", "chunks", "failures"):
        name = f"raging_kv_transfer_{field}_total"
        assert found[(name, send)] == getattr(SEND, field)
        assert found[(name, receive)] == getattr(RECEIVE, field)
        assert {k for k in found if k[0] == name} == {(name, send), (name, receive)}
    assert ('raging_kv_transfer_bytes_total{backend="shm",direction="send",worker="prefill-0"} '
            "3.221225472e+09\n") in text


def test_dropped_chunks_are_exported_per_worker_and_reason() -> None:
    registry = membership()
    beat(registry, "decode-0", [RECEIVE], DROPS)
    beat(registry, "decode-1", [RECEIVE], [DropCount("unknown request", 2)])
    text = Metrics().render(registry, Router(registry), 0).decode()
    dropped = {labels: value for (name, labels), value in samples(text).items()
               if name == "raging_kv_chunks_dropped_total"}
    assert dropped == {
        labels(worker="decode-0", reason="checksum"): 1,
        labels(worker="decode-0", reason="stale epoch"): 3,
        labels(worker="decode-0", reason="unknown request"): 7,
        labels(worker="decode-1", reason="unknown request"): 2,
    }
    assert 'raging_kv_chunks_dropped_total{reason="stale epoch",worker="decode-0"} 3.0\n' in text


def test_only_the_last_heartbeat_of_live_workers_counts() -> None:
    registry = membership()
    metrics = Metrics()
    beat(registry, "prefill-0", [SEND])
    beat(registry, "decode-0", [RECEIVE], DROPS)
    metrics.render(registry, Router(registry), 0)
    later = TransferTotals("shm", "send", chunks=61, bytes=3 * 2**30 + 10, seconds=1.5,
                           failures=2)
    beat(registry, "prefill-0", [later])
    registry.remove("decode-0")
    found = samples(metrics.render(registry, Router(registry), 0).decode())
    send = labels(worker="prefill-0", backend="shm", direction="send")
    assert found[("raging_kv_transfer_chunks_total", send)] == 61
    assert found[("raging_kv_transfer_bytes_total", send)] == 3 * 2**30 + 10
    kv_series = [k for k in found if k[0].startswith(KV_SERIES)]
    assert kv_series and all(dict(k[1])["worker"] == "prefill-0" for k in kv_series)


def test_workers_without_a_heartbeat_export_no_transfer_series() -> None:
    registry = membership()  # registered, never heartbeated
    text = Metrics().render(registry, Router(registry), 5).decode()
    found = samples(text)  # the whole exposition parses, with no name twice
    assert not [k for k in found if k[0].startswith(KV_SERIES)]
    assert found[("raging_control_messages_dropped", frozenset())] == 5


def test_progress_and_stalls_are_exported_per_worker() -> None:
    registry = Registry(FP, 3.0, 1, 1, stall_timeout_s=0.05)
    roles: tuple[tuple[str, Role], ...] = (("prefill-0", "prefill"), ("decode-0", "decode"))
    for worker_id, role in roles:
        assert registry.register(Register(worker_id, "i0", role, "", FP, 16, 100))[0].accepted
    assert registry.heartbeat(Heartbeat("decode-0", "i0", 0, 90, 1, 0, progress=90))
    time.sleep(0.06)  # decode-0 has work and no progress past the stall timeout
    assert registry.heartbeat(Heartbeat("prefill-0", "i0", 0, 100, 0, 0, progress=60))
    assert registry.heartbeat(Heartbeat("decode-0", "i0", 0, 90, 1, 0, progress=90))
    assert [w.worker_id for w in registry.newly_stalled()] == ["decode-0"]
    found = samples(Metrics().render(registry, Router(registry), 0).decode())
    assert found[("raging_worker_stalled", labels(worker="decode-0"))] == 1
    assert found[("raging_worker_stalled", labels(worker="prefill-0"))] == 0
    assert found[("raging_worker_progress", labels(worker="decode-0"))] == 90
    assert found[("raging_worker_progress", labels(worker="prefill-0"))] == 60


def test_each_workers_kernel_instruction_set_is_exported() -> None:
    registry = Registry(FP, 3.0, 1, 1)
    workers: tuple[tuple[str, Role, str], ...] = (
        ("prefill-0", "prefill", "avx2"), ("decode-0", "decode", "amx"),
        ("decode-1", "decode", "torch"))
    for worker_id, role, isa in workers:
        register = Register(worker_id, "i0", role, "", FP, 16, 100, "host-a", isa=isa)
        assert registry.register(register)[0].accepted
    found = samples(Metrics().render(registry, Router(registry), 0).decode())
    kernels = {dict(labels)["worker"]: dict(labels)["isa"]
               for name, labels in found if name == "raging_worker_kernels_info"}
    assert kernels == {"prefill-0": "avx2", "decode-0": "amx", "decode-1": "torch"}


def test_rejected_peers_are_exported_for_the_gateway_and_each_decode_worker() -> None:
    registry = membership()
    for worker_id, count in (("prefill-0", 0), ("decode-0", 4)):
        assert registry.heartbeat(Heartbeat(worker_id, "i0", 0, 90, 1, 0, rejected_peers=count))
    router = Router(registry)
    found = samples(Metrics().render(registry, router, 0, rejected_peers=2).decode())
    rejected = {dict(key)["worker"]: value for (name, key), value in found.items()
                if name == "raging_internal_rejected_total"}
    assert rejected == {"gateway": 2, "decode-0": 4}  # decode-1 has not reported yet
    family = next(f for f in text_string_to_metric_families(
        Metrics().render(registry, router, 0).decode()) if f.name == "raging_internal_rejected")
    assert family.type == "counter"


def test_disaggregation_decisions_are_counted_by_path() -> None:
    registry = membership()
    router = Router(registry)
    for prompt_len in (3, 40, 50):
        assert router.route(list(range(prompt_len))) is not None
    router.local = LocalPrefill(max_tokens=8)
    assert router.route([1, 2]) is not None
    families = {f.name: f for f in text_string_to_metric_families(
        Metrics().render(registry, router, dropped=0).decode())}
    counts = {s.labels["path"]: s.value for s in families["raging_disagg_decision"].samples}
    assert counts == {"disaggregated": 3, "local_short": 1, "local_saturated": 0,
                      "local_no_prefill": 0, "local_cached": 0, "local_prompt_logprobs": 0}


def test_recovery_counts_are_counters_that_never_decrease_across_a_worker_restart() -> None:
    registry = membership()
    assert registry.heartbeat(Heartbeat("decode-0", "i0", 0, 90, 1, 0, preemptions=5,
                                        guessed_tokens=40, kept_guesses=30))
    metrics, router = Metrics("m"), Router(registry)
    found = samples(metrics.render(registry, router, 0, aborts_sent=3, resumed=2).decode())
    assert found[("raging_aborts_sent_total", frozenset())] == 3
    assert found[("raging_requests_resumed_total", frozenset())] == 2
    assert found[("raging_worker_preemptions_total", labels(worker="decode-0"))] == 5
    # decode-0 restarts: a new instance whose own count begins at 0 again
    assert registry.register(Register("decode-0", "i1", "decode", "", FP, 16, 100))[0].accepted
    assert registry.heartbeat(Heartbeat("decode-0", "i1", 0, 90, 1, 0, preemptions=1,
                                        guessed_tokens=4, kept_guesses=1))
    found = samples(metrics.render(registry, router, 0, aborts_sent=3, resumed=2).decode())
    assert found[("raging_worker_preemptions_total", labels(worker="decode-0"))] == 6
    assert found[("raging_guessed_tokens_total", labels(worker="decode-0"))] == 44
    assert found[("raging_kept_guesses_total", labels(worker="decode-0"))] == 31
    engine = labels(model_name="m", engine="decode-0")
    assert found[("vllm:spec_decode_num_draft_tokens_total", engine)] == 44
    assert found[("vllm:spec_decode_num_accepted_tokens_total", engine)] == 31
    assert found[("vllm:num_preemptions_total", labels(model_name="m", engine="decode-0"))] == 6
    registry.remove("decode-0")  # gone: its count stays in the totals
    found = samples(metrics.render(registry, router, 0, aborts_sent=4, resumed=2).decode())
    assert found[("raging_worker_preemptions_total", labels(worker="decode-0"))] == 6
    assert found[("raging_aborts_sent_total", frozenset())] == 4
    types = {f.name: f.type for f in text_string_to_metric_families(
        metrics.render(registry, router, 0).decode())}
    for name in ("raging_aborts_sent", "raging_requests_resumed", "raging_worker_preemptions",
                 "vllm:num_preemptions"):
        assert types[name] == "counter", name


def test_every_metric_the_dashboard_reads_is_exposed() -> None:
    registry = membership()
    for worker_id in ("prefill-0", "decode-0", "decode-1"):
        beat(registry, worker_id, [SEND if worker_id.startswith("prefill") else RECEIVE])
    text = Metrics("m").render(registry, Router(registry), 0).decode()
    read = dashboard_metrics()
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
            "raging_disagg_decision_total", "raging_workers",
            "raging_stage_seconds_bucket"} <= read  # the parse finds them
    assert missing_from(text) == set()
    assert missing_from("") == read


def test_the_prometheus_config_scrapes_the_gateways_metrics_route() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    gateway = GatewayConfig()
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"{gateway.host}:{gateway.port}"]}]
