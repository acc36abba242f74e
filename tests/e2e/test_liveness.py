"""A long grammar compile on slowed workers kills no worker: on a fresh cluster with the
default timeouts, each worker shares its CPU with a busy-loop hog (so everything it does takes
about twice as long) while a structured-output request and then a tool-calls-shaped one (a
schema that takes seconds to compile) are served. Both succeed; /health, sampled throughout,
never loses a worker nor reports one stalled; the gateway declares none dead; and a worker's
compile outlasted the heartbeat timeout, its heartbeats flowing all along."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from core.config import GatewayConfig
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch
from tests.engine.sampling.test_grammar import tool_calls_schema

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

DEFAULTS = GatewayConfig()
CONFIG: dict[str, Any] = {**TEST_CONFIG, "gateway": {
    **TEST_CONFIG["gateway"], "heartbeat_timeout_s": DEFAULTS.heartbeat_timeout_s,
    "stall_timeout_s": DEFAULTS.stall_timeout_s}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "country": {"type": "string", "maxLength": 20}}}
# About 4 s to compile, unhogged; one call, as with parallel_tool_calls off (a greedy small
# model would call tool after tool).
TOOL_CALLS = {**tool_calls_schema(tools=500, params=6), "maxItems": 1}
COMPILED = re.compile(r"grammar compiled in ([0-9.]+) s")


class HealthSampler:
    """/health every 0.2 s from a thread, until stopped: (status code, body) each time."""

    def __init__(self, url: str) -> None:
        self.samples: list[tuple[int, dict[str, Any]]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,))
        self._thread.start()

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not self._stopping.wait(0.2):
                response = client.get("/health")
                self.samples.append((response.status_code, response.json()))

    def stop(self) -> list[tuple[int, dict[str, Any]]]:
        self._stopping.set()
        self._thread.join(60)
        return self.samples


def hog(cpus: set[int]) -> subprocess.Popen[bytes]:
    """A busy loop on `cpus`, stopped by its PID."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


@pytest.fixture(scope="module")
def cluster(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Pinned, one CPU each, so that each worker's hog halves its share of its CPU.
    with launch(tmp_path_factory.mktemp("run"), real_model_dir, config=CONFIG,
                flags=["--pin"]) as running:
        yield running


@pytest.fixture
def hogs(cluster: Cluster) -> Iterator[None]:
    """One hog on each worker's CPUs, for as long as the test runs."""
    workers = [pid for name, pid in cluster.pids().items() if name != "gateway"]
    started = [hog(os.sched_getaffinity(pid)) for pid in workers]
    try:
        yield
    finally:
        for process in started:
            process.kill()
            process.wait(timeout=30)


def ask(client: openai.OpenAI, model: str, prompt: str, name: str, schema: dict[str, Any]
        ) -> Any:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=400,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": name, "schema": schema}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content or "")
    jsonschema.validate(value, schema)
    return value


def test_a_long_compile_on_slowed_workers_kills_no_worker(cluster: Cluster, hogs: None) -> None:
    sampler = HealthSampler(cluster.url)
    try:
        with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                           timeout=600) as client:
            ask(client, cluster.model, "Name a city and its country.", "city", CITY)
            calls = ask(client, cluster.model, "Call a tool.", "calls", TOOL_CALLS)
    finally:
        samples = sampler.stop()
    assert calls and all(call["name"].startswith("tool_") for call in calls)
    assert len(samples) > 20
    for status, body in samples:
        assert (status, body) == (200, {"status": "ok", "prefill": 1, "decode": 1,
                                        "stalled": [], "draining": []})
    gateway = cluster.log("gateway")
    assert "declared dead" not in gateway and "stalled" not in gateway, gateway
    compiles = {name: [float(s) for s in COMPILED.findall(cluster.log(name))]
                for name in ("prefill-0", "decode-0")}
    assert all(len(times) == 2 for times in compiles.values()), compiles
    longest = max(max(times) for times in compiles.values())
    assert longest > DEFAULTS.heartbeat_timeout_s, compiles  # it lived through a long one
    for name in compiles:
        assert "registers again" not in cluster.log(name)
