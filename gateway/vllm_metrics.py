"""The metrics under vLLM's names and semantics, so that dashboards and schedulers made for vLLM
(its Grafana dashboards, the Gateway API Inference Extension) read raging unchanged.

Request-level series (tokens, latencies, finished requests, prefix cache) are measured at the
gateway and labelled `model_name`; engine-level ones (requests running and waiting, KV usage,
preemptions) come from each worker's last heartbeat and are labelled `model_name` and `engine`
(the worker id), the way vLLM labels the engines of a data-parallel deployment.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.registry import Registry

# vLLM's finish reasons: a stop string or token / max_tokens / the client left or the request
# was aborted / it failed.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's own buckets, so that quantiles read alike on both.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_INTERVAL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five_buckets(most: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's buckets for token counts)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > most:
                return buckets
            buckets.append(value)
        exponent += 1


class VllmMetrics:
    """The gateway-measured vLLM series, each bound to the served model's name."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in prompt tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in cached prompt tokens.")
        success = Counter("vllm:request_success", "Count of finished requests, by reason.",
                          [*labels, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.",
                                     TOKEN_INTERVAL_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the older name of the inter-token "
            "latency).", TOKEN_INTERVAL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of each request's decode time per output token after the first.",
            TOKEN_INTERVAL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)

    def finished(self, reason: str, prompt_tokens: int, generation_tokens: int,
                 decode_s: float | None) -> None:
        """One request (one choice of it) reached its end; `decode_s`: first token to last,
        None when it got no token."""
        assert reason in self.success, reason
        self.success[reason].inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if decode_s is not None and generation_tokens > 1:
            self.request_time_per_output_token.observe(decode_s / (generation_tokens - 1))

    def prefilled(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A prompt was prefilled: its tokens were looked up in the prefix cache."""
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)


class VllmEngineCollector(Collector):
    """The per-engine vLLM series, from each live worker's last heartbeat; preemptions for
    every worker id ever seen, monotonic across restarts (gateway.totals)."""

    def __init__(self, membership: Registry, model_name: str) -> None:
        self.membership = membership
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Number of requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Number of requests waiting to be processed.", labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        # The older name, which earlier Inference Extension releases read by default.
        gpu_usage = GaugeMetricFamily("vllm:gpu_cache_usage_perc",
                                      "KV-cache usage (the older name of "
                                      "vllm:kv_cache_usage_perc).", labels=labels)
        for worker in self.membership.workers.values():
            if worker.load is None or worker.num_blocks <= 0:
                continue
            engine = [self.model_name, worker.worker_id]
            running.add_metric(engine, worker.load.running)
            waiting.add_metric(engine, worker.load.waiting)
            used = worker.num_blocks - min(worker.load.free_blocks, worker.num_blocks)
            usage.add_metric(engine, used / worker.num_blocks)
            gpu_usage.add_metric(engine, used / worker.num_blocks)
        preemptions = CounterMetricFamily("vllm:num_preemptions",
                                          "Cumulative number of preemption from the engine.",
                                          labels=labels)
        for worker_id, count in self.membership.preemptions.by_worker().items():
            preemptions.add_metric([self.model_name, worker_id], count)
        drafted = CounterMetricFamily("vllm:spec_decode_num_draft_tokens",
                                      "Number of draft tokens.", labels=labels)
        accepted = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens",
                                       "Number of accepted tokens.", labels=labels)
        for family, totals in ((drafted, self.membership.guessed),
                               (accepted, self.membership.kept_guesses)):
            for worker_id, count in totals.by_worker().items():
                family.add_metric([self.model_name, worker_id], count)
        yield from (running, waiting, usage, gpu_usage, preemptions, drafted, accepted)
