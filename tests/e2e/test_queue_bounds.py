"""The gateway's queue bounds on a running cluster: past `max_inflight_requests` requests in
flight, or `max_queued_tokens` prompt tokens waiting for prefill, a request gets a 429 at once,
and those admitted finish."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch
from tests.e2e.test_worker_faults import complete, within

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bounded_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Cluster]:
    """1 prefill + 1 decode worker behind a queue of 4 requests and 100 prompt tokens."""
    bounds = {"max_inflight_requests": 4, "max_queued_tokens": 100}
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"], **bounds}}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config) as running:
        yield running


@pytest.mark.parametrize(("limit", "prompt_tokens", "fits", "refusal"), [
    ("requests", 10, 4, "too many requests in flight"),  # 40 tokens: under the token bound
    ("tokens", 30, 3, "90 prompt tokens are already waiting"),  # 3 requests: under 4
], ids=["requests", "tokens"])
def test_a_full_queue_answers_429_at_once_and_the_admitted_finish(
    bounded_cluster: Cluster, limit: str, prompt_tokens: int, fits: int, refusal: str
) -> None:
    cluster = bounded_cluster
    within(10, lambda: cluster.client.get("/health").status_code == 200)  # the case before's
    pid = cluster.pids()["prefill-0"]
    prompt = list(range(1000, 1000 + prompt_tokens))
    with ThreadPoolExecutor(fits) as pool:
        os.kill(pid, signal.SIGSTOP)  # nothing leaves the queue meanwhile
        try:
            admitted = [pool.submit(complete, cluster, prompt) for _ in range(fits)]
            time.sleep(0.5)
            started = time.monotonic()
            refused = cluster.client.post("/v1/completions", json={
                "model": cluster.model, "prompt": prompt, "max_tokens": 8})
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)  # within the heartbeat timeout
        for future in admitted:
            future.result(timeout=30)  # served: `complete` checks for a 200
    assert refused.status_code == 429 and took < 0.5
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and refusal in error["message"], limit
    within(10, lambda: cluster.metric("raging_requests_inflight") == 0)
