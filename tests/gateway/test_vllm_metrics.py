"""The vLLM-named series: per-request ones measured at the gateway, per-engine ones from the
workers' heartbeats (gateway.vllm_metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.config import Role
from core.messages import Heartbeat, Register
from gateway.registry import Registry
from gateway.vllm_metrics import VllmEngineCollector, VllmMetrics, one_two_five_buckets

FP = "tiny|float32|layers=2|kv_heads=2|head_dim=16"
MODEL = "SmolLM2-135M-Instruct"


def families(registry: CollectorRegistry) -> dict[str, tuple[str, dict[tuple[str, frozenset[
        tuple[str, str]]], float]]]:
    """name -> (type, {(sample name, labels): value})."""
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        found[family.name] = (family.type, {(s.name, frozenset(s.labels.items())): s.value
                                            for s in family.samples})
    return found


def test_token_buckets_run_one_two_five_up_to_the_longest_sequence() -> None:
    assert one_two_five_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert one_two_five_buckets(1) == [1]


def test_a_finished_request_counts_by_reason_with_its_token_counts() -> None:
    registry = CollectorRegistry()
    metrics = VllmMetrics(registry, MODEL, 2048)
    metrics.finished("stop", prompt_tokens=12, generation_tokens=5, decode_s=0.4)
    metrics.finished("abort", prompt_tokens=30, generation_tokens=0, decode_s=None)
    metrics.prefilled(12, 8)
    found = families(registry)
    kind, success = found["vllm:request_success"]
    assert kind == "counter"
    reasons = {dict(k[1])["finished_reason"]: v for k, v in success.items()
               if k[0] == "vllm:request_success_total"}
    assert reasons == {"stop": 1, "length": 0, "abort": 1, "error": 0}
    assert all(dict(k[1])["model_name"] == MODEL for k in success)
    kind, prompts = found["vllm:request_prompt_tokens"]
    assert kind == "histogram"
    model = frozenset({("model_name", MODEL)})
    assert prompts[("vllm:request_prompt_tokens_count", model)] == 2
    assert prompts[("vllm:request_prompt_tokens_sum", model)] == 42
    _, per_token = found["vllm:request_time_per_output_token_seconds"]
    assert per_token[("vllm:request_time_per_output_token_seconds_count", model)] == 1
    assert abs(per_token[("vllm:request_time_per_output_token_seconds_sum", model)] - 0.1) < 1e-9
    assert found["vllm:prefix_cache_queries"][1][("vllm:prefix_cache_queries_total", model)] == 12
    assert found["vllm:prefix_cache_hits"][1][("vllm:prefix_cache_hits_total", model)] == 8


def test_engines_report_running_waiting_and_kv_usage_as_a_fraction() -> None:
    membership = Registry(FP, 3.0, 1, 1)
    roles: tuple[tuple[str, Role], ...] = (("prefill-0", "prefill"), ("decode-0", "decode"))
    for worker_id, role in roles:
        assert membership.register(Register(worker_id, "i0", role, "", FP, 16, 100))[0].accepted
    assert membership.heartbeat(Heartbeat("prefill-0", "i0", 40, 100, 0, 3))
    assert membership.heartbeat(Heartbeat("decode-0", "i0", 0, 25, 6, 2, preemptions=4))
    registry = CollectorRegistry()
    registry.register(VllmEngineCollector(membership, MODEL))
    found = families(registry)

    def per_engine(name: str) -> dict[str, float]:
        kind, samples = found[name]
        assert kind == "gauge", name
        assert all(dict(k[1])["model_name"] == MODEL for k in samples)
        return {dict(k[1])["engine"]: v for k, v in samples.items()}

    assert per_engine("vllm:num_requests_running") == {"prefill-0": 0, "decode-0": 6}
    assert per_engine("vllm:num_requests_waiting") == {"prefill-0": 3, "decode-0": 2}
    assert per_engine("vllm:kv_cache_usage_perc") == {"prefill-0": 0.0, "decode-0": 0.75}
    assert per_engine("vllm:gpu_cache_usage_perc") == per_engine("vllm:kv_cache_usage_perc")
    kind, preemptions = found["vllm:num_preemptions"]
    assert kind == "counter"
    assert {dict(k[1])["engine"]: v for k, v in preemptions.items()} == {"prefill-0": 0,
                                                                         "decode-0": 4}
