"""Workers that wedge (SIGSTOP, or a loop stuck in a step while its liveness beats go on) or die
(SIGKILL) under load: readiness flips within the heartbeat (or stall) timeout, the API keeps
answering, and every request finishes whole, elsewhere or, when the last decode worker went, on
the one that comes back."""

from __future__ import annotations

import fcntl
import functools
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.launcher import free_port
from core.turns import turns_file
from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import TEST_CONFIG, Cluster, greedy_reference, launch, sse_events
from tests.reference import last_hidden_state

pytestmark = pytest.mark.e2e
HEARTBEAT_TIMEOUT_S = 3.0  # TEST_CONFIG's
STALL_TIMEOUT_S = 3.0


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path,
            ) -> Iterator[Cluster]:
    """1 prefill + 1 decode worker, or the (prefill, decode) counts a test asks for."""
    prefill, decode = getattr(request, "param", (1, 1))
    with launch(tmp_path, tiny_model_dir, prefill=prefill, decode=decode) as running:
        yield running


def within(seconds: float, condition: Callable[[], bool]) -> float:
    """How long `condition` took to hold; fails after `seconds`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, "not in time"
        time.sleep(0.1)
    return time.monotonic() - started


def completion_status(cluster: Cluster) -> int:
    body = {"model": cluster.model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    return cluster.client.post("/v1/completions", json=body).status_code


def test_streams_on_a_decode_worker_wedged_in_a_step_go_on_elsewhere(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A decode worker's loop stuck in its step (waiting for its CPU's turn, a lock the test
    holds, with a patience longer than the test) while its thread's liveness beats go on, as a
    deadlocked loop would be: the gateway
    calls it stalled within the stall timeout and /health names it, its streams go on on the
    other decode worker whole, and let go, it is taken back holding nothing."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    both = f"{first},{second}"  # decode-0 is pinned to `first`, decode-1 to `second`
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"],
                                         "stall_timeout_s": STALL_TIMEOUT_S},
              "engine": {**TEST_CONFIG.get("engine", {}), "cpu_turn_patience_s": 600.0}}
    flags = ["--prefill-cpus", both, "--decode-cpus", both]
    with launch(tmp_path, tiny_model_dir, decode=2, config=config, flags=flags) as cluster:
        workers = cluster.client.get("/v1/cluster").json()["workers"]
        assert {w["id"]: w["cpus"] for w in workers if w["role"] == "decode"} == {
            "decode-0": [first], "decode-1": [second]}
        prompts = [f"Story {i}: once upon a time" for i in range(6)]
        max_tokens = 120
        turn = os.open(turns_file(tmp_path / "turns", [first]), os.O_RDWR)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)  # decode-0's next step waits for it
            wedged_at = time.monotonic()
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(stream_text, cluster, p, max_tokens) for p in prompts]
                took = within(STALL_TIMEOUT_S + 4, lambda: cluster.client.get(
                    "/health").json()["stalled"] == ["decode-0"])
                assert cluster.client.get("/v1/models").status_code == 200
                results = [f.result(timeout=60) for f in futures]
            assert cluster.pids()["decode-0"]  # alive all along: stalled, never declared dead
        finally:
            os.close(turn)  # lets go of the lock
        assert_uninterrupted(tiny_model_dir, prompts, max_tokens, results)
        routed = re.findall(r"decode on (decode-\d)", cluster.log("gateway"))
        assert "decode-0" in routed[:len(prompts)]
        assert cluster.metric("raging_requests_resumed_total") >= 1
        assert "decode-0 is alive but has got nowhere" in cluster.log("gateway")
        within(10, lambda: cluster.client.get("/health").json() == {
            "status": "ok", "prefill": 1, "decode": 2, "stalled": [], "draining": []})
        within(10, lambda: cluster.metric("raging_kv_blocks_used", 'worker="decode-0"') == 0)
        assert completion_status(cluster) == 200
    print(f"decode-0 wedged: stalled {took:.1f} s after the first requests "
          f"(timeout {STALL_TIMEOUT_S:g} s), all {len(prompts)} streams whole "
          f"{time.monotonic() - wedged_at:.1f} s after the wedge")


def test_a_turn_kept_by_a_stuck_holder_stalls_no_worker_sharing_its_cpus(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A process that keeps the turn of the CPUs every worker computes on (stopped, or wedged
    in a step: here the test, holding the lock): past their patience the workers compute beside
    it, so none is called stalled and every stream finishes whole while it still holds it."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"],
                                         "stall_timeout_s": STALL_TIMEOUT_S},
              "engine": {**TEST_CONFIG.get("engine", {}), "cpu_turn_patience_s": 0.5},
              "prefill": {**TEST_CONFIG["prefill"], "threads": 0},  # threads filling the CPUs
              "decode": {**TEST_CONFIG["decode"], "threads": 0}}     # take turns on them
    with launch(tmp_path, tiny_model_dir, config=config, cpus=cpus) as cluster:
        workers = cluster.client.get("/v1/cluster").json()["workers"]
        assert all(w["cpus"] == cpus for w in workers)  # one turn for both workers
        prompts = [f"Tale {i}: long ago" for i in range(6)]
        turn = os.open(turns_file(tmp_path / "turns", cpus), os.O_RDWR)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)
            held_at = time.monotonic()
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(lambda p: stream_text(cluster, p, 60), prompts))
            time.sleep(max(0.0, held_at + STALL_TIMEOUT_S + 1 - time.monotonic()))
            health = cluster.client.get("/health").json()
        finally:
            os.close(turn)
        assert health["stalled"] == [] and health["status"] == "ok"
        assert_uninterrupted(tiny_model_dir, prompts, 60, results)
        assert cluster.metric("raging_requests_resumed_total") == 0
        assert "has got nowhere" not in cluster.log("gateway")
        assert "computing beside its holder" in cluster.log("decode-0")


@pytest.mark.parametrize("cluster", [(2, 1)], indirect=True)
def test_requests_on_a_killed_prefill_worker_finish_on_the_other(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    tokenizer, reference = _reference(tiny_model_dir)
    prompts = [f"Request number {i} says" for i in range(8)]
    pid = cluster.pids()["prefill-0"]  # the first that ties go to, whichever registered first
    os.kill(pid, signal.SIGSTOP)  # requests routed to it now wait there
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        futures = [pool.submit(complete, cluster, p) for p in prompts]
        embedded = pool.submit(cluster.client.post, "/v1/embeddings",
                               json={"input": prompts, "normalize": False})
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        texts = [f.result(timeout=60) for f in futures]
        vectors = embedded.result(timeout=60)
    recovered_s = time.monotonic() - started
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == decode_text(tokenizer, reference(tokenizer.encode(prompt), 8)), prompt
    assert vectors.status_code == 200, vectors.text
    for prompt, item in zip(prompts, vectors.json()["data"], strict=True):
        expected = last_hidden_state(tiny_model_dir, tokenizer.encode(prompt))
        torch.testing.assert_close(torch.tensor(item["embedding"], dtype=torch.float32),
                                   expected, atol=1e-4, rtol=1e-4)
    retried = cluster.metric("raging_requests_resumed_total")
    assert retried >= 1
    print(f"{len(prompts)} requests, 1 prefill worker killed, {retried:.0f} retried, "
          f"all done {recovered_s:.1f} s after the first was sent")


def complete(cluster: Cluster, prompt: str | list[int]) -> str:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    response = cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("cluster", [(1, 2)], indirect=True)
def test_streams_on_a_killed_decode_worker_go_on_elsewhere_without_a_gap(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    """SIGKILL mid-stream: each stream resumes on the other decode worker from what its client
    already has, and the whole text equals the uninterrupted run: the greedy one, and for a
    sampled stream with a seed, the same request's sent again once all is quiet."""
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    seeded = [(f"Fable {i}: a fox", {"temperature": 0.9, "seed": 11 + i}) for i in range(3)]
    max_tokens = 300
    pid = cluster.pids()["decode-0"]
    streaming = threading.Barrier(len(prompts) + len(seeded) + 1)
    with ThreadPoolExecutor(len(prompts) + len(seeded)) as pool:
        futures = [pool.submit(stream_text, cluster, p, max_tokens, streaming) for p in prompts]
        sampled = [pool.submit(stream_text, cluster, p, max_tokens, streaming, sampling)
                   for p, sampling in seeded]
        streaming.wait(timeout=30)  # every stream has its first tokens
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=60) for f in futures]
        sampled_results = [f.result(timeout=60) for f in sampled]
    assert_uninterrupted(tiny_model_dir, prompts, max_tokens, results)
    resumed = cluster.metric("raging_requests_resumed_total")
    assert 1 <= resumed <= len(prompts) + len(seeded)
    for (prompt, sampling), got in zip(seeded, sampled_results, strict=True):
        assert got == stream_text(cluster, prompt, max_tokens, sampling=sampling), prompt
    print(f"{len(prompts)} streams, 1 decode worker killed, {resumed:.0f} resumed, all done "
          f"{time.monotonic() - killed_at:.1f} s after the kill")


def assert_uninterrupted(model_dir: Path, prompts: list[str], max_tokens: int,
                         results: list[tuple[str, str | None, list[object]]]) -> None:
    """Each stream ended normally, with no error event, and holds the greedy text of
    transformers itself: no gap, no repeat."""
    for prompt, (text, finish, errors) in zip(prompts, results, strict=True):
        assert errors == [] and finish == "length", prompt
        assert text == greedy_text(model_dir, prompt, max_tokens), prompt


_GREEDY_RUNS: dict[tuple[Path, str], list[int]] = {}


@functools.cache
def _reference(model_dir: Path) -> tuple[PreTrainedTokenizerBase, Callable[..., list[int]]]:
    return AutoTokenizer.from_pretrained(model_dir), greedy_reference(model_dir)


def greedy_text(model_dir: Path, prompt: str, max_tokens: int) -> str:
    """transformers' greedy text of `prompt`, EOS ignored: the first `max_tokens` tokens of the
    longest run asked for so far (a greedy run's first tokens are those of a shorter one)."""
    tokenizer, reference = _reference(model_dir)
    run = _GREEDY_RUNS.get((model_dir, prompt), [])
    if len(run) < max_tokens:
        run = _GREEDY_RUNS[model_dir, prompt] = reference(tokenizer.encode(prompt), max_tokens)
    return decode_text(tokenizer, run[:max_tokens], skip_special_tokens=True)


def stream_text(cluster: Cluster, prompt: str, max_tokens: int,
                streaming: threading.Barrier | None = None,
                sampling: dict[str, float] | None = None,
                ) -> tuple[str, str | None, list[object]]:
    """A stream's text, finish reason and error events: greedy unless `sampling` says."""
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, **(sampling or {})}
    text, finish, errors = "", None, []
    with cluster.client.stream("POST", "/v1/completions", json=body) as response:
        for count, event in enumerate(sse_events(response)):
            if count == 3 and streaming is not None:
                streaming.wait(timeout=30)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                errors.append(event["error"])
                continue
            choice = event["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish, errors


def kill_decode_0_and_stream(cluster: Cluster, model_dir: Path, count: int) -> float:
    """SIGKILL decode-0, then stream `count` greedy requests at once: each must end whole, as
    the uninterrupted run. Returns when the kill was."""
    prompts = [f"Note {i}: the weather today" for i in range(count)]
    max_tokens = 24
    os.kill(cluster.pids()["decode-0"], signal.SIGKILL)
    killed_at = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream_text(cluster, p, max_tokens), prompts))
    assert_uninterrupted(model_dir, prompts, max_tokens, results)
    return killed_at


@pytest.mark.parametrize("cluster", [(1, 2)], indirect=True)
def test_requests_routed_to_a_decode_worker_just_killed_finish_on_the_other(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    """Before the gateway declares it dead, requests still go to the killed decode worker;
    their KV cannot reach it, and they are served again on the other one, with no error and
    the uninterrupted greedy text."""
    killed_at = kill_decode_0_and_stream(cluster, tiny_model_dir, 6)
    resumed = cluster.metric("raging_requests_resumed_total")
    assert resumed >= 1  # some were routed to the dead worker
    # ... and came back through the prefill worker's failed hand-off, not only (or not yet)
    # through the gateway's heartbeat timeout.
    assert "is not reachable" in (cluster.run_dir / "gateway.log").read_text()
    print(f"6 requests sent as decode-0 was killed, {resumed:.0f} resumed, all "
          f"done {time.monotonic() - killed_at:.1f} s after the kill")


def test_a_decode_worker_restarted_on_its_fixed_kv_port_gets_kv_again(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """`decode.kv_bind` on a fixed port (as behind a firewall, or in a pod): SIGKILLed and
    restarted by launch.sh on the same address, the worker gets KV again over the prefill
    worker's socket to that address; requests are served as before and sends stop failing."""
    tokenizer, reference = _reference(tiny_model_dir)
    config = {**TEST_CONFIG, "decode": {**TEST_CONFIG["decode"],
                                        "kv_bind": f"tcp://127.0.0.1:{free_port()}"}}
    prompts = [f"Request number {i} says" for i in range(6)]
    expected = [decode_text(tokenizer, reference(tokenizer.encode(p), 8)) for p in prompts]
    failures = 'backend="shm",direction="send",worker="prefill-0"'
    with launch(tmp_path, tiny_model_dir, config=config) as cluster:
        assert complete(cluster, prompts[0]) == expected[0]
        pid = cluster.pids()["decode-0"]
        os.kill(pid, signal.SIGKILL)
        within(30, lambda: cluster.pids()["decode-0"] != pid)
        assert [complete(cluster, p) for p in prompts[1:3]] == expected[1:3]
        time.sleep(1.5)  # the counters come with heartbeats (every 0.5 s): the last of them
        settled = cluster.metric("raging_kv_transfer_failures_total", failures)
        assert [complete(cluster, p) for p in prompts[3:]] == expected[3:]
        assert cluster.metric("raging_kv_transfer_failures_total", failures) == settled


@pytest.fixture(scope="module")
def only_decode(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Cluster]:
    """1 prefill + 1 decode worker, shared by the module's last tests, in their order: a wedge
    that ends, two kills that launch.sh restarts the worker after (one restart in a row, back
    once the worker has run RESTART_WINDOW_S), then one kill too soon after a restart."""
    flags = ["--restarts", "1", "--restart-window", str(RESTART_WINDOW_S)]
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, flags=flags) as running:
        yield running


RESTART_WINDOW_S = 2


def restarts(cluster: Cluster) -> int:
    """How many times launch.sh has restarted decode-0."""
    return (cluster.run_dir / "launch.log").read_text().count("restarting decode-0 (")


def test_a_wedged_decode_worker_flips_readiness_and_is_taken_back(only_decode: Cluster) -> None:
    """While the only decode worker is gone, a new request waits for one (gateway.worker_wait_s)
    rather than fail: it is served once the worker comes back."""
    cluster = only_decode
    pid = cluster.pids()["decode-0"]
    assert completion_status(cluster) == 200
    os.kill(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        try:
            took = within(HEARTBEAT_TIMEOUT_S + 2,
                          lambda: cluster.client.get("/health").status_code == 503)
            assert took <= HEARTBEAT_TIMEOUT_S + 1.5
            assert cluster.client.get("/v1/models").status_code == 200
            waiting = pool.submit(completion_status, cluster)
            time.sleep(1.0)
            assert not waiting.done()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert waiting.result(timeout=30) == 200
    within(10, lambda: cluster.client.get("/health").status_code == 200)
    assert completion_status(cluster) == 200


def test_streams_on_the_only_decode_worker_wait_for_its_restart_and_finish_whole(
    only_decode: Cluster, tiny_model_dir: Path
) -> None:
    """The only decode worker dies mid-stream: launch.sh starts it again, and meanwhile the
    gateway holds its streams, and a request sent after the death, until it registers. Every
    one ends with the uninterrupted greedy text, no error. (Stopped first until declared dead:
    a new process that registers sooner takes the streams over at once, without a wait.)"""
    cluster = only_decode
    prompts = [f"Story {i}: once upon a time" for i in range(4)]
    max_tokens = 300
    pid = cluster.pids()["decode-0"]
    restarted, resumed = restarts(cluster), cluster.metric("raging_requests_resumed_total")
    waits = cluster.log("gateway").count("waits up to 30 s for a decode worker")
    streaming = threading.Barrier(len(prompts) + 1)
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        futures = [pool.submit(stream_text, cluster, p, max_tokens, streaming) for p in prompts]
        streaming.wait(timeout=30)
        os.kill(pid, signal.SIGSTOP)
        within(HEARTBEAT_TIMEOUT_S + 5, lambda: cluster.client.get("/health").status_code == 503)
        prompts.append("Note: the weather today")
        futures.append(pool.submit(stream_text, cluster, prompts[-1], max_tokens))
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=90) for f in futures]
    assert_uninterrupted(tiny_model_dir, prompts, max_tokens, results)
    assert cluster.pids()["decode-0"] != pid
    assert restarts(cluster) == restarted + 1
    assert cluster.metric("raging_requests_resumed_total") - resumed >= len(prompts) - 1
    assert cluster.log("gateway").count("waits up to 30 s for a decode worker") > waits
    print(f"{len(prompts)} streams, the only decode worker killed, all done "
          f"{time.monotonic() - killed_at:.1f} s after the kill")


def test_requests_routed_to_the_only_decode_worker_just_killed_wait_for_its_restart(
    only_decode: Cluster, tiny_model_dir: Path
) -> None:
    """Before the gateway declares it dead, requests go to the killed worker, and their KV
    cannot reach it: rather than send them there again (and fail), they wait for the worker
    launch.sh starts again, and finish with the greedy text. The worker was restarted once
    already: having run for the restart window since, it has its one restart back."""
    time.sleep(RESTART_WINDOW_S + 0.5)
    restarted = restarts(only_decode)
    killed_at = kill_decode_0_and_stream(only_decode, tiny_model_dir, 3)
    assert restarts(only_decode) == restarted + 1
    print(f"3 requests sent as the only decode worker was killed, all done "
          f"{time.monotonic() - killed_at:.1f} s after the kill")


def test_a_worker_that_crashes_as_it_starts_is_given_up_on(only_decode: Cluster) -> None:
    """Restarted, then killed again before it has run for the restart window: launch.sh has
    no restart left for it (--restarts 1) and says so."""
    time.sleep(RESTART_WINDOW_S + 0.5)  # a restart to spend again
    restarted, pid = restarts(only_decode), only_decode.pids()["decode-0"]
    os.kill(pid, signal.SIGKILL)
    within(10, lambda: only_decode.pids()["decode-0"] != pid)
    os.kill(only_decode.pids()["decode-0"], signal.SIGKILL)
    launch_log = only_decode.run_dir / "launch.log"
    within(10, lambda: "decode-0 is not restarted" in launch_log.read_text())
    assert restarts(only_decode) == restarted + 1
