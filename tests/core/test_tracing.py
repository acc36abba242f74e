"""Spans exported over real OTLP/HTTP to a receiver on loopback; nothing imported when off."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from core.config import TracingConfig, load_config
from core.timeline import Timeline
from core.tracing import make_tracer, traces_url
from tests.e2e.otlp import otlp_receiver

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_with_no_endpoint_there_is_no_tracer_and_opentelemetry_is_never_imported() -> None:
    script = ("import sys; from core.config import TracingConfig; "
              "from core.tracing import make_tracer; import core.worker, gateway.state; "
              "assert make_tracer(TracingConfig(), 'raging-decode', 'd') is None; "
              "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("endpoint", "url"), [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/v1/traces", "https://otel.example/v1/traces"),
])
def test_a_collectors_base_url_gets_the_traces_path(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "grpc://127.0.0.1:4317", "http://"])
def test_an_endpoint_that_is_not_an_http_url_is_a_config_error(endpoint: str) -> None:
    with pytest.raises(ValueError, match="otlp_endpoint"):
        load_config(None, {"tracing.otlp_endpoint": endpoint})


def test_spans_reach_the_collector_in_one_trace_under_the_clients_context() -> None:
    with otlp_receiver() as receiver:
        tracer = make_tracer(TracingConfig(receiver.url), "raging-test", "w0")
        assert tracer is not None
        now = time.monotonic()
        request = tracer.open("POST /v1/completions", CLIENT, now - 1.0, {"raging.choices": 1})
        traceparent = tracer.traceparent(request)
        timeline = Timeline(arrived=now - 0.9, started=now - 0.8, computed=now - 0.5,
                            kv_ready=now - 0.5, first_decoded=now - 0.4)
        tracer.stages(traceparent, timeline, {"raging.request_id": "r"}, ended=now - 0.1,
                      outcome={"raging.finish_reason": "length"})
        tracer.close(request, now, {"raging.outcome": "ok"})
        tracer.shutdown()  # exports what is left
        spans = {s.name: s for s in receiver.wait_for(lambda got: len(got) >= 5, "5 spans")}
    assert set(spans) == {"POST /v1/completions", "prefill.queue", "prefill.compute",
                          "decode.generation", "decode.first_step"}  # no transfer: none came
    root = spans["POST /v1/completions"]
    assert traceparent == f"00-{root.trace_id}-{root.span_id}-01"
    assert root.trace_id == CLIENT.split("-")[1] and root.parent_id == CLIENT.split("-")[2]
    assert root.attributes == {"raging.choices": 1, "raging.outcome": "ok"}
    assert root.end_ns - root.start_ns == pytest.approx(1e9, rel=1e-3)
    for name in ("prefill.queue", "prefill.compute", "decode.generation"):
        assert spans[name].parent_id == root.span_id and spans[name].trace_id == root.trace_id
        assert spans[name].attributes["raging.worker_id"] == "w0"
    assert spans["decode.first_step"].parent_id == spans["decode.generation"].span_id
    assert spans["decode.generation"].attributes["raging.finish_reason"] == "length"
    assert spans["prefill.queue"].end_ns == spans["prefill.compute"].start_ns
    assert {s.service for s in spans.values()} == {"raging-test"}
