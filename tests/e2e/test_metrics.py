"""/metrics of a real cluster after real requests (the official openai client): the series vLLM's
dashboards and the Inference Extension read, with their types and plausible values; every
metric the Grafana dashboard reads; Counters that never go down while a decode worker is killed
by PID and started again under the same id."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, wait_for
from tests.gateway.dashboard import missing_from

MAX_TOKENS = 150  # 8 sequences of ~160 tokens need ~80 KV blocks of 16; the pool has 24
PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]
CONFIG = {**TEST_CONFIG, "decode": {**TEST_CONFIG["decode"], "num_kv_blocks": 24}}
# Series whose values are the workers' own since-start counts, which this slice leaves as they
# are: they restart with a worker.
WORKER_RESET = ("raging_kv_transfer_", "raging_kv_chunks_dropped", "raging_internal_rejected")

Sample = tuple[str, frozenset[tuple[str, str]]]


def scrape(cluster: Cluster) -> tuple[dict[str, str], dict[Sample, float]]:
    """Family name -> type, and every sample's value."""
    types: dict[str, str] = {}
    values: dict[Sample, float] = {}
    for family in text_string_to_metric_families(cluster.client.get("/metrics").text):
        types[family.name] = family.type
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return types, values


def total(values: dict[Sample, float], name: str, **wanted: str) -> float:
    """The sum of `name`'s samples whose labels include `wanted`."""
    return sum(v for (n, labels), v in values.items()
               if n == name and set(wanted.items()) <= labels)


def by_label(values: dict[Sample, float], name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in values.items() if n == name}


def counters(types: dict[str, str], values: dict[Sample, float]) -> dict[Sample, float]:
    """The samples that must never decrease: counters and histograms' buckets, sums, counts."""
    monotonic = {name + suffix for name, kind in types.items()
                 if kind in ("counter", "histogram") and not name.startswith(WORKER_RESET)
                 for suffix in ("_total", "_bucket", "_sum", "_count")}
    return {key: v for key, v in values.items() if key[0] in monotonic}


def complete(client: openai.OpenAI, model: str, prompt: str) -> int:
    """One streamed completion of MAX_TOKENS tokens; its prompt's token count."""
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    return usage.prompt_tokens


def complete_all(client: openai.OpenAI, model: str) -> int:
    """PROMPTS at once (enough to preempt on the small decode pool); their prompt tokens."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return sum(pool.map(lambda p: complete(client, model, p), PROMPTS))


class Watch:
    """Scrapes /metrics in the background; notes any counter that went down, and the highest
    KV usage seen per engine."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.decreased: list[str] = []
        self.peak_usage: dict[str, float] = {}
        self.last: dict[Sample, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.check(*scrape(self.cluster))

    def check(self, types: dict[str, str], values: dict[Sample, float]) -> None:
        now = counters(types, values)
        self.decreased += [f"{key}: {self.last[key]} -> {v}" for key, v in now.items()
                           if key in self.last and v < self.last[key]]
        self.decreased += [f"{key} vanished" for key in self.last if key not in now]
        self.last = now
        for engine, usage in by_label(values, "vllm:kv_cache_usage_perc", "engine").items():
            self.peak_usage[engine] = max(self.peak_usage.get(engine, 0.0), usage)


@contextmanager
def watching(cluster: Cluster) -> Iterator[Watch]:
    watch = Watch(cluster)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch.stop.set()
        thread.join(timeout=30)


def kill_for_a_restart(cluster: Cluster, name: str) -> None:
    """SIGKILL worker `name` by PID and wait until launch.sh has started it again (the same
    worker id, a new instance id), as it does any worker that crashes, and the new process has
    registered: until then the gateway may still count the killed one as serving."""
    pid = cluster.pids()[name]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: cluster.pids()[name] != pid, 60, f"launch.sh to restart {name}")
    assert f"restarting {name} (1 of 3)" in (cluster.run_dir / "launch.log").read_text()

    def joined_again() -> bool:
        events = cluster.client.get("/v1/cluster").json()["events"]
        return any(event["worker_id"] == name and event["at"] > killed_at
                   and event["kind"] in ("registered", "restarted") for event in events)
    wait_for(joined_again, 120, f"the new {name} to register")


def check_vllm_series(cluster: Cluster, prompt_tokens: int) -> dict[Sample, float]:
    """After len(PROMPTS) finished requests and one aborted: vLLM's names, types and counts."""
    types, values = scrape(cluster)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert types[name] == "gauge", name
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert types[name] == "counter", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert types[name] == "histogram", name
    finished, model = len(PROMPTS), {"model_name": cluster.model}
    reasons = by_label(values, "vllm:request_success_total", "finished_reason")
    assert reasons == {"stop": 0, "length": finished, "abort": 1, "error": 0}
    assert all(dict(key[1])["model_name"] == cluster.model for key in values
               if key[0].startswith("vllm:"))
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_generation_tokens",
                 "vllm:request_prompt_tokens"):
        assert total(values, f"{name}_count", **model) == finished + 1, name  # the abort too
    assert total(values, "vllm:e2e_request_latency_seconds_count", **model) == finished
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert total(values, f"{name}_count") >= finished * (MAX_TOKENS - 1), name
    assert total(values, "vllm:request_generation_tokens_sum") >= finished * MAX_TOKENS
    assert total(values, "vllm:generation_tokens_total") == total(
        values, "vllm:request_generation_tokens_sum")
    assert total(values, "vllm:prompt_tokens_total") == total(
        values, "vllm:request_prompt_tokens_sum") > prompt_tokens
    assert total(values, "vllm:prefix_cache_queries_total") >= prompt_tokens
    assert 0 <= total(values, "vllm:prefix_cache_hits_total") <= total(
        values, "vllm:prefix_cache_queries_total")
    engines = {"prefill-0", "decode-0"}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert by_label(values, name, "engine") == dict.fromkeys(engines, 0), name
    usage = by_label(values, "vllm:kv_cache_usage_perc", "engine")
    assert set(usage) == engines and all(0 <= u <= 1 for u in usage.values())
    assert usage["decode-0"] == 0  # every request's blocks freed
    assert by_label(values, "vllm:gpu_cache_usage_perc", "engine") == usage
    assert by_label(values, "vllm:num_preemptions_total", "engine")["decode-0"] > 0
    assert missing_from(cluster.client.get("/metrics").text) == set()
    return values


def abort_one(client: openai.OpenAI, model: str) -> None:
    """A stream the client leaves after its first token."""
    stream = client.completions.create(model=model, prompt="Leaving early", stream=True,
                                       max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()


def test_vllm_series_and_counters_that_survive_a_decode_worker_restart(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with launch(tmp_path / "run", tiny_model_dir, config=CONFIG) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", timeout=300,
                               max_retries=0)
        with watching(cluster) as watch:
            prompt_tokens = complete_all(client, cluster.model)
            abort_one(client, cluster.model)
            wait_for(lambda: total(scrape(cluster)[1], "vllm:request_success_total",
                                   finished_reason="abort") == 1, 60, "the abort to count")
            time.sleep(1.5)  # heartbeats after the last request
            before = check_vllm_series(cluster, prompt_tokens)
            kill_for_a_restart(cluster, "decode-0")
            wait_for(lambda: cluster.client.get("/health").status_code == 200, 120,
                     "the restarted decode worker")
            complete_all(client, cluster.model)
            time.sleep(1.5)
            after = scrape(cluster)[1]
        assert 0 < watch.peak_usage["decode-0"] <= 1
    assert not watch.decreased, watch.decreased[:10]
    preempted = ("raging_worker_preemptions_total", frozenset({("worker", "decode-0")}))
    assert after[preempted] > before[preempted]  # the new instance's on top of the old one's
    assert total(after, "vllm:request_success_total", finished_reason="length") == 2 * len(
        PROMPTS)
    assert after[("raging_aborts_sent_total", frozenset())] >= 1
