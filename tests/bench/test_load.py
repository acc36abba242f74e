"""The request loops (with a fake server call), SSE parsing and target parsing."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from itertools import pairwise

import pytest

from bench.client import RequestResult, StreamError, api_root, has_content, parse_event
from bench.load import Load, arrival_offsets, closed_loop, open_loop
from bench.serve import Target
from bench.workloads import RequestSpec

SPECS = [RequestSpec(i, "fixed", "hi", None, 4) for i in range(12)]


class FakeServer:
    """Answers each request after `seconds`, tracking how many are in flight."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.in_flight = 0
        self.most = 0
        self.sent: list[float] = []

    async def send(self, spec: RequestSpec) -> RequestResult:
        self.sent.append(time.perf_counter())
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.seconds)
        self.in_flight -= 1
        return RequestResult(spec.index, spec.kind, 0.0, None, spec.output_len)


def test_closed_loop_keeps_concurrency_streams_busy() -> None:
    server = FakeServer(0.02)
    results = asyncio.run(closed_loop(server.send, SPECS, concurrency=4, deadline=None))
    assert sorted(r.index for r in results) == list(range(12))
    assert server.most == 4


def test_closed_loop_stops_at_the_deadline() -> None:
    server = FakeServer(0.05)
    results = asyncio.run(closed_loop(server.send, SPECS, 2, time.perf_counter() + 0.12))
    assert 2 <= len(results) <= 6  # 2 streams x 3 sends fit 0.12 s; none after it


def test_poisson_arrivals() -> None:
    offsets = arrival_offsets(2001, rate=4.0, rng=random.Random(0))
    assert offsets[0] == 0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd = mean
    assert arrival_offsets(5, 4.0, random.Random(1)) == arrival_offsets(5, 4.0, random.Random(1))


def test_open_loop_sends_at_the_rate_with_a_cap() -> None:
    server = FakeServer(0.1)
    load = Load(concurrency=3, rate=200.0, seed=0)
    start = time.perf_counter()
    results = asyncio.run(open_loop(server.send, SPECS, load, deadline=None))
    assert len(results) == 12 and server.most == 3
    assert time.perf_counter() - start >= 0.4  # 12 requests, 3 at a time, 0.1 s each


def test_open_loop_stops_sending_at_the_deadline() -> None:
    server = FakeServer(0.0)
    load = Load(rate=20.0, seed=0)
    results = asyncio.run(open_loop(server.send, SPECS, load, time.perf_counter() + 0.2))
    assert 1 <= len(results) < 12


def test_load_needs_a_concurrency_or_a_rate() -> None:
    for bad in ({}, {"concurrency": 0}, {"rate": 0.0}, {"concurrency": 1, "duration_s": -1}):
        with pytest.raises(ValueError):
            Load(**bad)


def test_sse_parsing() -> None:
    chunk = parse_event('data: {"choices": [{"text": "Hi", "finish_reason": null}]}')
    assert chunk is not None and has_content(chunk)
    assert parse_event("data: [DONE]") is None and parse_event(": keepalive") is None
    assert parse_event("") is None
    assert not has_content({"choices": [], "usage": {"completion_tokens": 3}})
    assert not has_content({"choices": [{"text": "", "finish_reason": "length"}]})
    assert has_content({"choices": [{"delta": {"content": "x"}}]})
    assert not has_content({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    with pytest.raises(StreamError, match="error in stream"):
        parse_event('data: {"error": {"message": "boom"}}')
    with pytest.raises(StreamError, match="malformed"):
        parse_event("data: {not json")


def test_targets_and_urls() -> None:
    assert api_root("http://h:1/v1/") == "http://h:1" and api_root("http://h:1") == "http://h:1"
    assert Target.from_url("http://h:8000/v1") == Target("h:8000", "http://h:8000/v1")
    assert Target.from_url("vllm=http://h:8000") == Target("vllm", "http://h:8000")
    ours = Target.from_launch("--prefill 1 --decode 2")
    assert ours.label == "raging --prefill 1 --decode 2" and ours.url is None
    assert ours.launch_flags == ("--prefill", "1", "--decode", "2")
    named = Target.from_launch("p1d2=--prefill 1 --decode 2 --set decode.threads=1")
    assert named.label == "p1d2" and named.launch_flags is not None
    assert named.launch_flags[-1] == "decode.threads=1"
    assert Target.from_launch("--set a.b=1").label == "raging --set a.b=1"
    assert Target.from_launch("").launch_flags == ()
