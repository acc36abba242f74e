"""OpenTelemetry spans of requests across processes, exported over OTLP/HTTP.

Off unless `tracing.otlp_endpoint` is set: `make_tracer` then returns None, opentelemetry is
never imported, and each call site costs one None check. When on, every process exports its own
spans; a request's spans share one trace because the gateway's request span travels, as a W3C
`traceparent` string, in the PrefillRequest and on in the DecodeRequest. Spans are made after
the fact from the monotonic stamps the stage accounting takes anyway (core/timeline.py), so the
workers' loops do no tracing work per step. The span tree is in docs/observability.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from core.config import TracingConfig
from core.timeline import Timeline

if TYPE_CHECKING:
    from opentelemetry.trace import Span

Attributes = Mapping[str, str | int | float | bool]
_EXPORT_EVERY_MS = 1000  # spans reach the collector this soon after they end


def make_tracer(config: TracingConfig, service: str, instance: str) -> Tracer | None:
    """The process's tracer (`service` e.g. raging-gateway, `instance` its worker id); None,
    and nothing imported, when tracing is off."""
    if not config.otlp_endpoint:
        return None
    return Tracer(traces_url(config.otlp_endpoint), service, instance)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector (an http(s) URL, as TracingConfig checks): its
    base URL gets `/v1/traces`."""
    has_path = urlsplit(endpoint).path.strip("/")
    return endpoint if has_path else endpoint.rstrip("/") + "/v1/traces"


class Tracer:
    """One process's spans, batched to the collector by a background thread."""

    def __init__(self, url: str, service: str, instance: str) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url), schedule_delay_millis=_EXPORT_EVERY_MS))
        self.tracer = self.provider.get_tracer("raging")
        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()
        self.instance = instance
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def wall_ns(self, monotonic: float) -> int:
        """A `time.monotonic()` stamp as the epoch nanoseconds spans are dated in."""
        return self.offset_ns + int(monotonic * 1e9)

    def open(self, name: str, traceparent: str | None, start: float,
             attributes: Attributes) -> Span:
        """A span still running (end it with `close`): a child of the `traceparent` context
        (a client's, say), or the root of a new trace when there is none or it is malformed."""
        parent = self.propagator.extract({"traceparent": traceparent}) if traceparent else None
        return self.tracer.start_span(name, context=parent, kind=self.trace.SpanKind.SERVER,
                                      attributes=attributes, start_time=self.wall_ns(start))

    def close(self, span: Span, end: float, attributes: Attributes) -> None:
        span.set_attributes(attributes)
        span.end(end_time=self.wall_ns(end))

    def traceparent(self, span: Span) -> str:
        """The W3C traceparent naming `span` as the parent of spans in other processes."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self.trace.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def record(self, name: str, parent: str | Span, start: float, end: float,
               attributes: Attributes) -> Span:
        """A span over already: a child of `parent` (a span, or a traceparent from another
        process; an empty one makes a trace of its own)."""
        if isinstance(parent, str):
            context = self.propagator.extract({"traceparent": parent}) if parent else None
        else:
            context = self.trace.set_span_in_context(parent)
        span = self.tracer.start_span(name, context=context, attributes=attributes,
                                      start_time=self.wall_ns(start))
        span.end(end_time=self.wall_ns(end))
        return span

    def stages(self, traceparent: str, timeline: Timeline, attributes: Attributes,
               ended: float | None = None, outcome: Attributes | None = None) -> None:
        """A worker's spans of one request, from its stamps: prefill.queue and prefill.compute
        where it prefilled, kv.transfer where its KV arrived, and once it `ended` here,
        decode.generation (with `outcome`) over decode.first_step."""
        t = timeline
        tagged = {**attributes, "raging.worker_id": self.instance}
        if t.arrived is not None and t.started is not None and t.computed is not None:
            self.record("prefill.queue", traceparent, t.arrived, t.started, tagged)
            self.record("prefill.compute", traceparent, t.started, t.computed, tagged)
        if t.first_kv is not None and t.kv_ready is not None:
            self.record("kv.transfer", traceparent, t.first_kv, t.kv_ready, tagged)
        if ended is not None and t.kv_ready is not None:
            generation = self.record("decode.generation", traceparent, t.kv_ready, ended,
                                     {**tagged, **(outcome or {})})
            if t.first_decoded is not None:
                self.record("decode.first_step", generation, t.kv_ready, t.first_decoded,
                            tagged)

    def shutdown(self) -> None:
        """Export what is left, then stop the exporter."""
        self.provider.shutdown()
