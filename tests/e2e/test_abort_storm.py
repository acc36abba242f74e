"""Aborts at every phase of a request leave every worker as it started: no block, no sequence,
no transfer held. Normal completions send no aborts."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.sim_streams import PHASES, abandon
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch

pytestmark = pytest.mark.e2e

REQUESTS = 1000
CONCURRENCY = 48
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = {**TEST_CONFIG, "kv_transfer": {"backend": "shm", "buffer_mb": 4}}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, prefill=2, decode=2,
                config=config) as running:
        yield running


def body(model: str, rng: random.Random) -> dict:
    prompt = [rng.randrange(100, 40000) for _ in range(rng.choice([1, 15, 16, 17, 64, 300]))]
    return {"model": model, "prompt": prompt, "max_tokens": rng.choice([2, 40, 200]),
            "temperature": 0, "ignore_eos": True, "stream": True}


async def storm(url: str, model: str) -> Counter[str]:
    rng = random.Random(7)
    outcomes: Counter[str] = Counter()
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        async def one(i: int) -> None:
            async with gate:
                outcomes[await abandon(client, body(model, rng), rng, PHASES[i % len(PHASES)],
                                       timeout_s=30)] += 1
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    return outcomes


def settled(cluster: Cluster, timeout_s: float = 30.0) -> dict[str, float]:
    """The accounting once every worker reports itself idle (it follows their heartbeats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {f"{name} {w}": cluster.metric(name, f'worker="{w}"') for w in WORKERS
                 for name in ("raging_kv_blocks_used", "raging_worker_running",
                              "raging_worker_waiting", "raging_kv_in_transfer")}
        state["inflight"] = cluster.metric("raging_requests_inflight")
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.3)


def test_a_thousand_aborts_at_random_phases_leak_nothing(cluster: Cluster) -> None:
    started = time.monotonic()
    outcomes = asyncio.run(storm(cluster.url, cluster.model))
    assert outcomes["timeout"] == 0 and sum(outcomes.values()) == REQUESTS
    for _ in range(2):  # and still so a second later: a leak would not go away
        state = settled(cluster)
        assert not any(state.values()), {k: v for k, v in state.items() if v}
        time.sleep(1.0)
    assert cluster.client.get("/health").status_code == 200
    # Each staged region came back because its reader said so, not because its lease ran out.
    assert [cluster.metric("raging_kv_leases_expired", f'worker="{w}"')
            for w in WORKERS[:2]] == [0, 0]
    aborts = cluster.metric("raging_aborts_sent_total")
    print(f"{REQUESTS} requests, {outcomes}, {aborts:.0f} aborts sent, leaked blocks 0, "
          f"settled in {time.monotonic() - started:.1f} s")


def test_normal_completions_send_no_aborts(cluster: Cluster) -> None:
    before = cluster.metric("raging_aborts_sent_total")
    for max_tokens in (1, 2, 9):
        response = cluster.client.post("/v1/completions", json={
            "model": cluster.model, "prompt": "Hello there", "max_tokens": max_tokens,
            "ignore_eos": True})
        assert response.status_code == 200
    assert cluster.metric("raging_aborts_sent_total") == before
