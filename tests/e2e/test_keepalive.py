"""SSE keepalive: a stream that waits (its prefill worker paused) gets comments, never a long
silence, and then its tokens."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch

pytestmark = pytest.mark.e2e

KEEPALIVE_S = 1.0
PAUSE_S = 6.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # The pause must not look like a death: heartbeats may stop for longer than it lasts.
    gateway = {**TEST_CONFIG["gateway"], "keepalive_s": KEEPALIVE_S, "heartbeat_timeout_s": 30.0}
    config = {**TEST_CONFIG, "gateway": gateway}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config) as running:
        yield running


def test_a_waiting_stream_gets_keepalives_and_then_its_tokens(cluster: Cluster) -> None:
    prefill = cluster.pids()["prefill-0"]
    body = {"model": cluster.model, "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": True}
    os.kill(prefill, signal.SIGSTOP)
    resume = threading.Timer(PAUSE_S, os.kill, (prefill, signal.SIGCONT))
    resume.start()
    try:
        arrivals: list[tuple[float, str]] = [(time.monotonic(), "(sent)")]
        with cluster.client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    arrivals.append((time.monotonic(), line))
    finally:
        resume.join()
        os.kill(prefill, signal.SIGCONT)
    comments = [line for _, line in arrivals if line.startswith(":")]
    data = [line for _, line in arrivals if line.startswith("data: ")]
    times = [t for t, _ in arrivals]
    assert len(comments) >= PAUSE_S / KEEPALIVE_S - 2, comments
    assert max(b - a for a, b in itertools.pairwise(times)) < KEEPALIVE_S + 0.5
    assert data[-1] == "data: [DONE]" and len(data) == 8 + 1
