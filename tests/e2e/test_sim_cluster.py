"""A simulated model (`--model sim`) behind the real gateway, workers, channels and KV: every
stream is the one the token chain predicts, which it is only if every position's KV reached
its decode worker whole and under the right request; a killed decode worker's streams go on
elsewhere, still right."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from bench.client import read_stream
from bench.serve import open_client
from bench.sim_streams import (
    SimRequest,
    StreamOutcome,
    run_streams,
    sim_requests,
    summarize,
)
from engine.sim.folder import scaled_kv, sim_folder
from engine.sim.profile import load_profile
from engine.sim.tokens import continuation, text_of
from engine.weights.spec import load_spec
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, post_raw, wait_for

pytestmark = pytest.mark.e2e

MEAN = load_profile("default").mean_output_tokens
MODELS = "~/.cache/raging/models"
CONFIG = {**TEST_CONFIG, "sim": {"kv_bytes": 0.25, "time_scale": 0.3},
          "decode": {**TEST_CONFIG["decode"], "num_kv_blocks": 1024, "max_running": 128},
          "prefill": {**TEST_CONFIG["prefill"], "num_kv_blocks": 1024}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), "sim", prefill=2, decode=2,
                config=CONFIG) as running:
        yield running


def test_two_hundred_streams_are_each_the_predicted_one(cluster: Cluster) -> None:
    requests = sim_requests(200, 60, seed=11, prompt_lens=(1, 400))
    began = time.monotonic()
    outcomes = asyncio.run(run_streams(cluster.url, cluster.model, requests, timeout_s=120))
    summary = summarize(requests, outcomes, time.monotonic() - began, MEAN)
    assert (summary.right, summary.failed) == (200, 0), summary
    sent = sum(cluster.metric("raging_kv_transfer_bytes_total",
                              f'backend="shm",direction="send",worker="prefill-{i}"')
               for i in range(2))
    assert sent >= sum(len(r.prompt) for r in requests) * kv_bytes_per_token()


def kv_bytes_per_token() -> int:
    """The cluster's KV per token: a quarter of SmolLM2-135M's, in bf16."""
    spec = scaled_kv(load_spec(sim_folder("default", MODELS)), CONFIG["sim"]["kv_bytes"])
    return spec.kv_bytes_per_token(torch.bfloat16)


def test_a_chat_answer_is_the_chain_over_its_templated_prompt(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    tokenizer = AutoTokenizer.from_pretrained(sim_folder("default", MODELS))
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            tokenize=False))
    answer = cluster.client.post("/v1/chat/completions", json={
        "model": cluster.model, "messages": messages, "max_tokens": 300, "temperature": 0.7,
        "seed": 3}).json()
    expected = continuation(prompt, 300, MEAN)
    assert answer["choices"][0]["message"]["content"] == text_of(expected)
    assert answer["usage"]["completion_tokens"] == len(expected)
    assert answer["choices"][0]["finish_reason"] == ("stop" if expected[-1] > 255 else "length")


def test_a_killed_decode_workers_streams_finish_right_elsewhere(cluster: Cluster) -> None:
    requests = sim_requests(120, 150, seed=12)
    resumed_before = cluster.metric("raging_requests_resumed_total")

    def kill_one_midway() -> None:
        wait_for(lambda: cluster.metric("raging_worker_running", 'worker="decode-0"') >= 20,
                 60, "streams on decode-0")
        os.kill(cluster.pids()["decode-0"], signal.SIGKILL)

    killer = threading.Thread(target=kill_one_midway)
    killer.start()
    began = time.monotonic()
    outcomes = asyncio.run(run_streams(cluster.url, cluster.model, requests, timeout_s=180))
    killer.join()
    summary = summarize(requests, outcomes, time.monotonic() - began, MEAN)
    assert (summary.right, summary.failed) == (120, 0), summary
    # The streams it held at the kill resumed (how many were still unfinished is timing's).
    assert cluster.metric("raging_requests_resumed_total") > resumed_before


def test_a_prefill_worker_killed_mid_hand_off_leaves_decode_clean_and_its_requests_right(
        tmp_path: Path) -> None:
    """Prefill slowed (time_scale 25: a prompt's step takes ~4 s, its KV streamed layer by
    layer) and killed while decode holds part of a prompt's KV: decode drops it (nothing in
    transfer, no block, no lease run out), lives on, and each request is served again on the
    other prefill worker, still the predicted stream."""
    config = {**CONFIG, "sim": {**CONFIG["sim"], "time_scale": 25.0}}
    requests = sim_requests(2, 3, seed=13, prompt_lens=(600, 700))
    with launch(tmp_path, "sim", prefill=2, decode=1, config=config) as cluster:
        decode_pid = cluster.pids()["decode-0"]

        def kill_the_sender() -> None:
            senders: list[str] = []  # a prefill worker holding a prompt's blocks, once seen

            def sending() -> bool:
                senders[:] = [w for w in ("prefill-0", "prefill-1")
                              if cluster.metric("raging_kv_blocks_used", f'worker="{w}"')]
                return bool(senders) and cluster.metric(
                    "raging_kv_in_transfer", 'worker="decode-0"') > 0
            wait_for(sending, 60, "KV in transfer to decode-0")
            os.kill(cluster.pids()[senders[0]], signal.SIGKILL)

        with ThreadPoolExecutor(1) as pool:
            killed = pool.submit(kill_the_sender)
            began = time.monotonic()
            outcomes = asyncio.run(run_streams(cluster.url, cluster.model, requests,
                                               timeout_s=120))
            killed.result()
        summary = summarize(requests, outcomes, time.monotonic() - began, MEAN)
        assert (summary.right, summary.failed) == (2, 0), summary
        assert cluster.metric("raging_requests_resumed_total") >= 1
        assert cluster.pids()["decode-0"] == decode_pid and os.path.exists(f"/proc/{decode_pid}")
        held = ("raging_kv_in_transfer", "raging_kv_blocks_used", "raging_worker_running",
                "raging_kv_leases_expired")
        wait_for(lambda: not any(cluster.metric(name, 'worker="decode-0"') for name in held),
                 30, "decode-0 to hold nothing")


async def ttft_s(url: str, model: str, request: SimRequest) -> float:
    """Seconds to the first token of one streamed request."""
    async with open_client(url, None, 120) as client:
        began = time.perf_counter()
        arrivals, _, _ = await read_stream(client, "/v1/completions", request.body(model), began)
    assert arrivals, "no token came"
    return arrivals[0]


async def send_and_leave(url: str, model: str, request: SimRequest, after_s: float) -> None:
    """Send a streamed request, then drop the connection `after_s` later."""
    _, writer = await post_raw(url, "/v1/completions", request.body(model))
    await asyncio.sleep(after_s)
    writer.close()


def test_a_client_that_leaves_a_long_prefill_stops_it_at_once(tmp_path: Path) -> None:
    """Peer failure: a disconnect during a long prefill, before its first token. Prefill slowed
    (time_scale 50: each 256-token chunk takes seconds) on a 1,800-token prompt, its client
    gone 200 ms in: the prefill worker stops it within a layer (it never hands off), a short
    request sent at the same moment gets its first token as fast as one sent to an idle
    cluster, and no KV stays reserved on either worker."""
    config = {**CONFIG, "sim": {**CONFIG["sim"], "time_scale": 50.0}}
    long_prompt, = sim_requests(1, 4, seed=21, prompt_lens=(1800, 1800))
    shorts = sim_requests(4, 2, seed=22, prompt_lens=(8, 8))
    with launch(tmp_path, "sim", config=config) as cluster:
        idle = max(asyncio.run(ttft_s(cluster.url, cluster.model, r)) for r in shorts[:3])

        async def leave_then_ask() -> float:
            left = asyncio.create_task(send_and_leave(cluster.url, cluster.model, long_prompt,
                                                      0.2))
            await asyncio.sleep(0.2)
            ttft = await ttft_s(cluster.url, cluster.model, shorts[3])
            await left
            return ttft

        behind = asyncio.run(leave_then_ask())
        assert behind <= 2 * idle + 0.5, (behind, idle)
        def blocks_held() -> float:
            return sum(cluster.metric("raging_kv_blocks_used", f'worker="{worker}"')
                       for worker in ("prefill-0", "decode-0"))

        wait_for(lambda: not blocks_held(), 5, "both workers to hold no KV block")
        log = cluster.log("prefill-0")
        [long_id] = [line.split("request ")[1].split(":")[0] for line in log.splitlines()
                     if ": 1800 prompt tokens" in line]
        assert f"request {long_id}: first token" not in log  # stopped, never handed off
        assert "aborted mid-prefill" in log


async def leave_after_first_token(url: str, model: str, request: SimRequest,
                                  got_first: asyncio.Queue[None], leave: asyncio.Event) -> None:
    """Stream a request; once its first token has come, say so, and drop the connection when
    told to."""
    reader, writer = await post_raw(url, "/v1/completions", request.body(model))
    async with asyncio.timeout(60):
        while b'"text": "' not in await reader.readline():
            pass
    got_first.put_nowait(None)
    await leave.wait()
    writer.close()


def test_clients_that_leave_between_first_token_and_decode_admission_leave_nothing(
        tmp_path: Path) -> None:
    """Peer failure: a disconnect after prefill is done, before decode admits the request.
    decode runs one sequence at a time (`max_running` 1) and a long stream holds that slot,
    so each of 200 requests gets its first token (from prefill) and its KV reaches decode,
    then waits there; its client leaves then. Nothing of theirs stays on either worker, and
    the long stream, and one after, are the predicted ones."""
    config = {**CONFIG, "decode": {**CONFIG["decode"], "max_running": 1}}
    long_stream, after = sim_requests(2, 1500, seed=31, prompt_lens=(16, 16))
    after = SimRequest(after.prompt, 100)
    leaving = sim_requests(200, 8, seed=32, prompt_lens=(8, 24))
    with launch(tmp_path, "sim", config=config) as cluster:
        def at_decode() -> float:
            return sum(cluster.metric(name, 'worker="decode-0"') for name in (
                "raging_worker_waiting", "raging_kv_in_transfer"))

        async def run() -> list[StreamOutcome]:
            holder = asyncio.create_task(run_streams(cluster.url, cluster.model, [long_stream],
                                                     timeout_s=120))
            await asyncio.to_thread(wait_for, lambda: cluster.metric(
                "raging_worker_running", 'worker="decode-0"') == 1, 10, "the long stream")
            got_first: asyncio.Queue[None] = asyncio.Queue()
            leave = asyncio.Event()
            clients = [asyncio.create_task(leave_after_first_token(
                cluster.url, cluster.model, r, got_first, leave)) for r in leaving]
            for _ in leaving:
                await got_first.get()
            # Each is on decode, not admitted: its KV arriving or arrived (heartbeats tell).
            await asyncio.to_thread(wait_for, lambda: at_decode() == len(leaving), 10,
                                    "every request to reach decode")
            leave.set()
            await asyncio.gather(*clients)
            return await holder

        outcomes = asyncio.run(run())
        assert outcomes[0].text == long_stream.expected(MEAN) and not outcomes[0].error
        held = ("raging_worker_waiting", "raging_kv_in_transfer", "raging_kv_leases_expired")
        wait_for(lambda: not any(cluster.metric(name, 'worker="decode-0"') for name in held),
                 10, "decode-0 to hold none of the requests that left")
        wait_for(lambda: not cluster.metric("raging_kv_blocks_used", 'worker="prefill-0"'),
                 10, "prefill-0 to hold no KV block")
        assert not cluster.metric("raging_kv_leases_expired", 'worker="prefill-0"')
        [served] = asyncio.run(run_streams(cluster.url, cluster.model, [after], timeout_s=60))
        assert served.text == after.expected(MEAN) and not served.error
        wait_for(lambda: not cluster.metric("raging_kv_blocks_used", 'worker="decode-0"'),
                 10, "decode-0 to hold no KV block")
