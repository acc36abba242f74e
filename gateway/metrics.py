"""Prometheus metrics of the gateway: requests, tokens, latencies, queue, KV blocks per worker;
the same under vLLM's names (gateway.vllm_metrics). docs/metrics.md lists every series."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from core.config import ROLES, Role
from core.messages import STAGES, Stage
from gateway.recent import RecentLatency
from gateway.registry import Registry
from gateway.routing import ROUTE_PATHS, Router
from gateway.vllm_metrics import VllmEngineCollector, VllmMetrics

disable_created_metrics()
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, *_LATENCY_BUCKETS)  # a KV hand-off can take under 1 ms
_ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.025)


class Histograms:
    """One observation recorded in several histograms: ours and vLLM's."""

    def __init__(self, *histograms: Histogram) -> None:
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for histogram in self.histograms:
            histogram.observe(value)


class Counters:
    """One count added to several counters: ours and vLLM's."""

    def __init__(self, *counters: Counter) -> None:
        self.counters = counters

    def inc(self, amount: float = 1) -> None:
        for counter in self.counters:
            counter.inc(amount)


class Metrics:
    """`model_name` labels the vLLM-named series (the served model's name); `max_model_len`
    bounds their token-count buckets."""

    def __init__(self, model_name: str = "", max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(self.registry, model_name, max_model_len)
        self.recent = RecentLatency()  # TTFT and TPOT of the last minutes, for the web page
        self._add_request_series()
        self._add_pool_gauges()
        self._add_worker_gauges()
        self._add_gateway_series()

    def _add_request_series(self) -> None:
        """Requests and their tokens and latencies, each also under vLLM's name."""
        r, vllm = self.registry, self.vllm
        self.requests = Counter("raging_requests", "Requests by route and outcome",
                                ["route", "outcome"], registry=r)
        self.prompt_tokens = Counters(
            Counter("raging_prompt_tokens", "Prompt tokens admitted", registry=r),
            vllm.prompt_tokens)
        self.generation_tokens = Counters(
            Counter("raging_generation_tokens", "Tokens generated", registry=r),
            vllm.generation_tokens)
        self.ttft = Histograms(
            Histogram("raging_time_to_first_token_seconds", "Arrival to first token",
                      buckets=_LATENCY_BUCKETS, registry=r), vllm.ttft)
        self.inter_token = Histograms(
            Histogram("raging_inter_token_latency_seconds", "Between tokens",
                      buckets=_LATENCY_BUCKETS, registry=r),
            vllm.inter_token, vllm.time_per_output_token)
        self.e2e = Histograms(
            Histogram("raging_e2e_request_latency_seconds", "Arrival to last token",
                      buckets=_LATENCY_BUCKETS, registry=r), vllm.e2e)
        self.stage = Histogram("raging_stage_seconds",
                               "Time in each stage on the way to the first tokens, measured "
                               "where the stage runs (docs/observability.md)", ["stage"],
                               buckets=_STAGE_BUCKETS, registry=r)
        for stage in STAGES:
            self.stage.labels(stage)

    def _add_pool_gauges(self) -> None:
        """Requests in flight and the pools' workers."""
        r = self.registry
        self.inflight = Gauge("raging_requests_inflight", "Requests admitted, not finished",
                              registry=r)
        self.queued = Gauge("raging_requests_queued", "Requests waiting for their first token",
                            registry=r)
        self.workers = Gauge("raging_workers", "Live workers", ["role"], registry=r)
        self.draining = Gauge("raging_workers_draining", "Live workers draining: no new work, "
                              "they leave once done", ["role"], registry=r)
        self.desired = Gauge("raging_pool_desired_workers", "Workers each pool wants, from the "
                             "queues, KV use and latency against the SLOs (autoscale:)",
                             ["role"], registry=r)

    def _add_worker_gauges(self) -> None:
        """Per worker, refreshed from the registry at each render."""
        r = self.registry
        self.kv_used = Gauge("raging_kv_blocks_used", "KV blocks in use", ["worker"], registry=r)
        self.kv_total = Gauge("raging_kv_blocks_total", "KV blocks", ["worker"], registry=r)
        self.running = Gauge("raging_worker_running", "Sequences running", ["worker"], registry=r)
        self.waiting = Gauge("raging_worker_waiting", "Sequences waiting for KV blocks",
                             ["worker"], registry=r)
        self.in_transfer = Gauge("raging_kv_in_transfer",
                                 "KV in flight: requests arriving (decode), chunks staged "
                                 "and not yet released (prefill)", ["worker"], registry=r)
        self.leases_expired = Gauge("raging_kv_leases_expired",
                                    "KV reservations reclaimed after their lease ran out",
                                    ["worker"], registry=r)
        self.progress = Gauge("raging_worker_progress", "Model layers computed since start",
                              ["worker"], registry=r)
        self.kernels = Gauge("raging_worker_kernels_info", "1 for the instruction set each "
                             "worker's kernels run at (isa: generic, avx2, avx512, avx512_bf16, "
                             "amx; torch where none built; cuda on a GPU)", ["worker", "isa"],
                             registry=r)
        self.stalled = Gauge("raging_worker_stalled",
                             "1 while the worker has work but computes nothing (not routed to)",
                             ["worker"], registry=r)

    def _add_gateway_series(self) -> None:
        """The gateway's own work: control messages, request fields, routing."""
        r = self.registry
        self.dropped = Gauge("raging_control_messages_dropped", "Malformed control messages",
                             registry=r)
        self.ignored_fields = Counter("raging_ignored_fields",
                                      "Request fields outside the schema, accepted and ignored",
                                      ["field"], registry=r)
        self.route = Histogram("raging_route_seconds", "CPU time the gateway takes to pick a "
                               "request's workers (each route, resumes too)",
                               buckets=_ROUTE_BUCKETS,
                               registry=r)
        self.control_messages = Counter("raging_control_messages", "Control messages received "
                                        "from workers, by kind", ["kind"], registry=r)

    def observe_route(self, seconds: float) -> None:
        self.route.observe(seconds)

    def count_message(self, kind: str) -> None:
        self.control_messages.labels(kind).inc()

    def observe_stage(self, stage: Stage, seconds: float) -> None:
        self.stage.labels(stage).observe(seconds)

    def render(self, membership: Registry, routing: Router, dropped: int, aborts_sent: int = 0,
               resumed: int = 0, rejected_peers: int = 0,
               desired: dict[Role, int] | None = None) -> bytes:
        """The exposition text, with the per-worker gauges refreshed from the registry and the
        routing counts from the router; `rejected_peers`: the gateway's own count of peers
        that failed CURVE authentication."""
        for gauge in (self.kv_used, self.kv_total, self.running, self.waiting,
                      self.in_transfer, self.leases_expired, self.progress, self.stalled,
                      self.kernels):
            gauge.clear()
        for role in ROLES:
            alive = membership.alive(role)
            self.workers.labels(role).set(len(alive))
            self.draining.labels(role).set(sum(w.draining for w in alive))
            if desired is not None:
                self.desired.labels(role).set(desired[role])
        for worker in membership.workers.values():
            name = worker.worker_id
            if worker.load is not None:
                self.kv_used.labels(name).set(worker.num_blocks - worker.load.free_blocks)
                self.running.labels(name).set(worker.load.running)
                self.waiting.labels(name).set(worker.load.waiting)
                self.in_transfer.labels(name).set(worker.load.in_transfer)
                self.leases_expired.labels(name).set(worker.load.leases_expired)
                self.progress.labels(name).set(worker.load.progress)
            self.kv_total.labels(name).set(worker.num_blocks)
            self.stalled.labels(name).set(int(worker.stalled))
            if worker.isa:
                self.kernels.labels(name, worker.isa).set(1)
        self.dropped.set(dropped)
        transfers = CollectorRegistry()
        transfers.register(TransferCollector(membership))
        transfers.register(RejectedPeersCollector(membership, rejected_peers))
        transfers.register(DecisionCollector(routing))
        transfers.register(PullCollector(membership, routing))
        transfers.register(RecoveryCollector(membership, aborts_sent, resumed))
        transfers.register(VllmEngineCollector(membership, self.vllm.model_name))
        return generate_latest(self.registry) + generate_latest(transfers)


class TransferCollector(Collector):
    """KV transfer totals per worker and backend, as the workers last reported them."""

    def __init__(self, membership: Registry) -> None:
        self.membership = membership

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "backend", "direction"]
        families = {
            "bytes": CounterMetricFamily("raging_kv_transfer_bytes", "KV bytes moved",
                                         labels=labels),
            "seconds": CounterMetricFamily("raging_kv_transfer_seconds",
                                           "Time spent sending or receiving KV", labels=labels),
            "chunks": CounterMetricFamily("raging_kv_transfer_chunks", "KV chunks moved",
                                          labels=labels),
            "failures": CounterMetricFamily("raging_kv_transfer_failures", "KV sends that failed",
                                            labels=labels),
        }
        dropped = CounterMetricFamily("raging_kv_chunks_dropped",
                                      "KV chunks dropped (corrupt, stale epoch, unknown request)",
                                      labels=["worker", "reason"])
        for worker in self.membership.workers.values():
            if worker.load is None:
                continue
            for totals in worker.load.transfers:
                values = [worker.worker_id, totals.backend, totals.direction]
                for name, family in families.items():
                    family.add_metric(values, getattr(totals, name))
            for count in worker.load.dropped_chunks:
                dropped.add_metric([worker.worker_id, count.reason], count.count)
        yield from families.values()
        yield dropped


class RejectedPeersCollector(Collector):
    """Peers turned away by the internal channels' CURVE authentication: the gateway's control
    socket, and each decode worker's KV socket as its last heartbeat said."""

    def __init__(self, membership: Registry, gateway: int) -> None:
        self.membership = membership
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("raging_internal_rejected",
                                     "Peers that failed authentication on an internal socket",
                                     labels=["worker"])
        family.add_metric(["gateway"], self.gateway)
        for worker in self.membership.workers.values():
            if worker.role == "decode" and worker.load is not None:
                family.add_metric([worker.worker_id], worker.load.rejected_peers)
        yield family


class DecisionCollector(Collector):
    """Conditional disaggregation: the routes the gateway has taken, by path."""

    def __init__(self, routing: Router) -> None:
        self.routing = routing

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("raging_disagg_decision",
                                     "Requests routed, by path: disaggregated (a prefill worker) "
                                     "or prefilled on the decode worker (local_*)",
                                     labels=["path"])
        for path in ROUTE_PATHS:
            family.add_metric([path], self.routing.decisions[path])
        yield family


class PullCollector(Collector):
    """Cached prefixes pulled between workers: asked for by the gateway (by the holder's
    pool), and as decode workers counted them (monotonic across their restarts)."""

    def __init__(self, membership: Registry, routing: Router) -> None:
        self.membership = membership
        self.routing = routing

    def collect(self) -> Iterator[Metric]:
        asked = CounterMetricFamily("raging_kv_pulls_routed", "Prompts routed to pull a cached "
                                    "prefix, by the pool of the worker holding it",
                                    labels=["holder_role"])
        for role in ROLES:
            asked.add_metric([role], self.routing.pulls[role])
        pulls = CounterMetricFamily("raging_kv_pulls", "Cached prefixes pulled by a decode "
                                    "worker: pulled (came whole) or fallback (computed)",
                                    labels=["worker", "outcome"])
        amounts = {
            "tokens": CounterMetricFamily("raging_kv_pull_tokens", "Prompt tokens pulled "
                                          "rather than computed", labels=["worker"]),
            "bytes": CounterMetricFamily("raging_kv_pull_bytes", "KV bytes pulled",
                                         labels=["worker"]),
            "seconds": CounterMetricFamily("raging_kv_pull_seconds", "Time from asking for a "
                                           "prefix to holding it all", labels=["worker"]),
            "saved_s": CounterMetricFamily("raging_kv_pull_saved_seconds", "Prefill time the "
                                           "pulled tokens would have taken (as measured on "
                                           "the worker) less the pulls' time",
                                           labels=["worker"]),
        }
        pulled = self.membership.pulled
        for worker_id, count in pulled["pulls"].by_worker().items():
            pulls.add_metric([worker_id, "pulled"], count)
        for worker_id, count in pulled["fallbacks"].by_worker().items():
            pulls.add_metric([worker_id, "fallback"], count)
        for name, family in amounts.items():
            for worker_id, value in pulled[name].by_worker().items():
                family.add_metric([worker_id], value)
        yield from (asked, pulls, *amounts.values())


class RecoveryCollector(Collector):
    """What the gateway did to keep requests going, as Counters: aborts it sent, requests it
    resumed elsewhere; and per worker, preemptions and speculation's guesses, made and kept
    (monotonic across restarts, gateway.totals)."""

    def __init__(self, membership: Registry, aborts_sent: int, resumed: int) -> None:
        self.membership = membership
        self.aborts_sent = aborts_sent
        self.resumed = resumed

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("raging_aborts_sent", "Aborts the gateway sent to workers",
                                  value=self.aborts_sent)
        yield CounterMetricFamily("raging_requests_resumed",
                                  "Requests resumed on other workers after losing one",
                                  value=self.resumed)
        preemptions = CounterMetricFamily("raging_worker_preemptions",
                                          "Sequences preempted, per worker id since the gateway "
                                          "started", labels=["worker"])
        for worker_id, count in self.membership.preemptions.by_worker().items():
            preemptions.add_metric([worker_id], count)
        yield preemptions
        for name, totals, what in (
                ("raging_guessed_tokens", self.membership.guessed,
                 "Tokens guessed by n-gram speculation, per decode worker"),
                ("raging_kept_guesses", self.membership.kept_guesses,
                 "Guessed tokens the draws kept, per decode worker")):
            family = CounterMetricFamily(name, what, labels=["worker"])
            for worker_id, count in totals.by_worker().items():
                family.add_metric([worker_id], count)
            yield family
