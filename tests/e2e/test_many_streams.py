"""Thousands of streams at once on a simulated model (peer failure: a server that opens a socket
per request runs out of file descriptors at about a thousand). The cluster starts under a
soft open-files limit of 1,024, as many machines set it. Every stream must be the one the
simulated model predicts; the gateway holds one socket per client connection and gives each
back; the workers' descriptors do not grow with the load. The client is plain asyncio sockets:
an HTTP client's connection pool would cost more CPU at this count than the whole cluster."""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.scale import Peak, process_use
from bench.sim_streams import SimRequest, sim_requests
from engine.sim.profile import load_profile
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, post_raw, wait_for

pytestmark = pytest.mark.e2e

STREAMS = 5000
SOFT_LIMIT = 1024
WORKER_FD_SLACK = 16  # a worker's descriptors may vary by this much, whatever the load
CONFIG = {**TEST_CONFIG, "sim": {"kv_bytes": 0.25, "time_scale": 0.1},
          "gateway": {**TEST_CONFIG["gateway"], "max_inflight_requests": STREAMS + 100,
                      "max_queued_tokens": 1_000_000},
          "decode": {**TEST_CONFIG["decode"], "num_kv_blocks": 4096, "max_running": 256},
          "prefill": {**TEST_CONFIG["prefill"], "num_kv_blocks": 1024}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), "sim", config=CONFIG,
                open_files=SOFT_LIMIT) as running:
        yield running


def open_fds(pid: int) -> float:
    return process_use(pid)["fds"]


async def stream_text(url: str, model: str, request: SimRequest) -> str:
    """One streamed completion over its own connection: the text of its chunks."""
    reader, writer = await post_raw(url, "/v1/completions", request.body(model))
    reply = await reader.read()
    writer.close()
    head, _, chunked = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = [json.loads(line[6:]) for line in dechunk(chunked).split(b"\n")
              if line.startswith(b"data: {")]
    return "".join(choice["text"] for event in events for choice in event["choices"])


def dechunk(body: bytes) -> bytes:
    """A chunked transfer-encoded body, whole."""
    whole, at = bytearray(), 0
    while True:
        size_end = body.index(b"\r\n", at)
        size = int(body[at:size_end], 16)
        if size == 0:
            return bytes(whole)
        whole += body[size_end + 2:size_end + 2 + size]
        at = size_end + 2 + size + 2


async def all_streams(url: str, model: str, requests: list[SimRequest]) -> list[str]:
    async with asyncio.timeout(400):
        return list(await asyncio.gather(*(stream_text(url, model, r) for r in requests)))


def test_five_thousand_streams_at_once_each_the_predicted_one(cluster: Cluster) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client holds 5,000 too
    pids = cluster.pids()
    gateway = pids["gateway"]
    assert int(Path(f"/proc/{gateway}/limits").read_text().split("Max open files")[1]
               .split()[0]) > STREAMS, "the gateway raised its soft limit"
    before = {name: open_fds(pid) for name, pid in pids.items()}
    requests = sim_requests(STREAMS, 4, seed=5, prompt_lens=(1, 32))
    with ExitStack() as watching:
        peaks = {name: watching.enter_context(Peak(pid, every_s=0.05))
                 for name, pid in pids.items()}
        texts = asyncio.run(all_streams(cluster.url, cluster.model, requests))
    peak = {name: watched.most["fds"] for name, watched in peaks.items()}
    mean_output = load_profile("default").mean_output_tokens
    wrong = [i for i, (r, text) in enumerate(zip(requests, texts, strict=True))
             if text != r.expected(mean_output)]
    assert not wrong, f"{len(wrong)} streams differ from the predicted ones, as {wrong[:5]}"
    # Far more than the 1,024 the cluster started with were open at once ...
    assert peak["gateway"] > before["gateway"] + 2 * SOFT_LIMIT, peak
    for name in pids.keys() - {"gateway"}:  # ... and none of them inside the cluster
        assert peak[name] <= before[name] + WORKER_FD_SLACK, (name, peak, before)
    wait_for(lambda: open_fds(gateway) <= before["gateway"] + 4, 30,
             "the gateway to close its client sockets")
    assert cluster.metric("raging_requests_total",
                          'outcome="ok",route="completions"') >= STREAMS
