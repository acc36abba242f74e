"""Scaling a live cluster: workers join a running gateway over TCP (`launch.sh --join`) and
drain away (`POST /admin/drain/{worker}`, SIGTERM to their launch.sh) while greedy streams run;
every stream completes, equal to the reference, and the pools' sizes follow in /health."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from bench.launcher import free_port, stop
from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import (
    ROOT,
    TEST_CONFIG,
    Cluster,
    alive,
    launch,
    sse_events,
    wait_for,
)

pytestmark = pytest.mark.e2e

API_KEY = "sk-scaling-test"
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "Hello",
           "Paris is the capital of", "1, 2, 3, 4,", "Roses are red,", "SELECT * FROM"]
SHORT, LONG = 32, 160  # output tokens: streams that outlive a drain are the long ones
# Four sequences a decode worker: the rest wait in its queue, so that a drain has work to finish.
CONFIG: dict[str, Any] = {**TEST_CONFIG, "decode": {**TEST_CONFIG["decode"], "max_running": 4}}
JOIN_TIMEOUT_S = 120


@contextmanager
def joined(run_dir: Path, model: Path, config: Path, control: str, keys: Path, prefill: int,
           decode: int) -> Iterator[subprocess.Popen[bytes]]:
    """`launch.sh --join`: workers joining the cluster at `control`; stopped by PID after."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [str(ROOT / "scripts/launch.sh"), "--join", control, "--keys", str(keys),
               "--prefill", str(prefill), "--decode", str(decode), "--model", str(model),
               "--config", str(config), "--run-dir", str(run_dir)]
    with (run_dir / "launch.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            yield process
        finally:
            stop(process, run_dir)


@pytest.fixture(scope="module")
def greedy(tokenizer: PreTrainedTokenizerBase, reference: Callable[[list[int], int], list[int]]
           ) -> dict[str, list[int]]:
    """Each prompt's greedy continuation, LONG tokens (a shorter one is its start)."""
    return {p: reference(tokenizer.encode(p), LONG) for p in PROMPTS}


def pools(cluster: Cluster) -> tuple[int, int]:
    health = httpx.get(cluster.url + "/health", timeout=5).json()
    return health["prefill"], health["decode"]


def stream(cluster: Cluster, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with cluster.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    chunks = [e for e in events if isinstance(e, dict)]
    return {"text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
            "errors": [c for c in chunks if "error" in c], "done": events[-1] == "[DONE]"}


def workers(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.client.get("/v1/cluster").json()["workers"]


def queued(worker: dict[str, Any]) -> int:
    """Requests a worker's last heartbeat said wait behind its full batch."""
    return worker["waiting"] or 0


def test_a_live_cluster_scales_up_and_down_under_64_streams(
        tiny_model_dir: Path, tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
        greedy: dict[str, list[int]]) -> None:
    keys, control = tmp_path / "keys", f"tcp://127.0.0.1:{free_port()}"
    flags = ["--control", control, "--keys", str(keys), "--api-key", API_KEY]
    expected = {(p, n): decode_text(tokenizer, greedy[p][:n], skip_special_tokens=True)
                for p in PROMPTS for n in (SHORT, LONG)}
    with launch(tmp_path / "base", tiny_model_dir, 1, 1, CONFIG, flags=flags,
                api_key=API_KEY) as cluster, ThreadPoolExecutor(64) as pool:
        submitted: list[tuple[str, int, Future[dict[str, Any]]]] = []

        def submit(count: int, max_tokens: int) -> None:
            for i in range(count):
                prompt = PROMPTS[i % len(PROMPTS)]
                submitted.append((prompt, max_tokens, pool.submit(stream, cluster, prompt,
                                                                  max_tokens)))

        submit(16, SHORT)  # on 1P+1D, while 1P+2D join
        started = time.monotonic()
        with joined(tmp_path / "join", tiny_model_dir, cluster.run_dir / "config.yaml", control,
                    keys, 1, 2) as launcher:
            wait_for(lambda: launcher.poll() is not None or pools(cluster) == (2, 3),
                     JOIN_TIMEOUT_S, "2P+3D")
            assert launcher.poll() is None, (tmp_path / "join" / "launch.log").read_text()
            join_s = time.monotonic() - started
            submit(32, LONG)  # spread over three decode workers
            mine = [w["id"] for w in workers(cluster)
                    if w["role"] == "decode" and w["id"] != "decode-0"]
            assert len(mine) == 2
            # A queue behind a full batch (from heartbeats: what the worker itself holds) is a
            # whole long stream's work left to finish when the drain begins.
            wait_for(lambda: any(queued(w) for w in workers(cluster) if w["id"] in mine),
                     JOIN_TIMEOUT_S, "a queue on a joined decode worker")
            backlog = {w["id"]: queued(w) for w in workers(cluster)}
            mine.sort(key=lambda worker_id: -backlog[worker_id])  # the busiest drains first
            refused = httpx.post(f"{cluster.url}/admin/drain/{mine[0]}", timeout=5)
            assert refused.status_code == 401  # behind the API key
            missing = cluster.client.post("/admin/drain/decode-nobody")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == \
                "not_found_error"
            drained = cluster.client.post(f"/admin/drain/{mine[0]}")
            assert drained.status_code == 202 and drained.json()["state"] == "draining"
            launcher.send_signal(signal.SIGTERM)  # the rest of the joined workers drain
            submit(16, SHORT)  # only the first pair takes these
            drain_started = time.monotonic()
            launcher.wait(timeout=JOIN_TIMEOUT_S)
            drain_s = time.monotonic() - drain_started
        results = [(prompt, n, future.result(timeout=JOIN_TIMEOUT_S))
                   for prompt, n, future in submitted]
        assert pools(cluster) == (1, 1)
        health = httpx.get(cluster.url + "/health", timeout=5).json()
        assert health["status"] == "ok" and health["draining"] == []
        events = cluster.client.get("/v1/cluster").json()["events"]
        left = [e for e in events if e["kind"] == "left"]
        assert len(left) == 3 and all(e["detail"] == "drained" for e in left)
        assert cluster.metric("raging_workers_draining", 'role="decode"') == 0
        assert cluster.metric("raging_requests_resumed_total") == 0  # finished, not resumed
        logs = {path.name: path.read_text() for path in (tmp_path / "join").glob("decode-*.log")}
    assert len(results) == 64
    for prompt, n, result in results:
        assert result["errors"] == [] and result["done"], (prompt, n)
        assert result["text"] == expected[(prompt, n)], (prompt, n)
    held = [int(log.split(" requests held")[0].rsplit(": ", 1)[1]) for log in logs.values()]
    assert len(held) == 2 and sum(held) > 0, "a draining decode worker had streams to finish"
    print(f"join 1P+2D: {join_s:.1f} s; drain of 1P+2D: {drain_s:.1f} s")


def test_a_sigterm_drains_an_idle_worker_and_its_pool_shrinks(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    with launch(tmp_path, tiny_model_dir, 1, 2, CONFIG) as cluster:
        pid = cluster.pids()["decode-1"]
        wait_for(lambda: pools(cluster) == (1, 2), 30, "every worker serving")
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not alive(pid), 30, "the idle worker to drain and leave")
        assert pools(cluster) == (1, 1)
        assert httpx.get(cluster.url + "/health", timeout=5).json()["status"] == "ok"
        assert "drained in" in cluster.log("decode-1")
        # A gateway launch.sh starts again waits for the workers still here, not the drained.
        gateway = cluster.pids()["gateway"]
        os.kill(gateway, signal.SIGKILL)
        wait_for(lambda: cluster.pids()["gateway"] != gateway, 30, "the gateway's restart")
        wait_for(lambda: _health(cluster) == ("ok", 1, 1), 30, "ok again, with 1P+1D")


def _health(cluster: Cluster) -> tuple[str, int, int] | None:
    try:
        health = httpx.get(cluster.url + "/health", timeout=5).json()
    except httpx.HTTPError:  # restarting
        return None
    return health["status"], health["prefill"], health["decode"]


# Two sequences a decode worker before it wants another; back down 2 s after the load ends;
# the wish read every 0.5 s.
AUTOSCALE_CONFIG: dict[str, Any] = {
    **CONFIG, "autoscale": {"decode_batch_fraction": 0.5, "scale_down_s": 2.0,
                            "tpot_slo_ms": 60000.0, "ttft_slo_ms": 60000.0, "poll_s": 0.5}}


def test_autoscale_grows_the_decode_pool_under_load_and_drains_it_after(
        tiny_model_dir: Path, tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
        greedy: dict[str, list[int]]) -> None:
    expected = {p: decode_text(tokenizer, greedy[p], skip_special_tokens=True) for p in PROMPTS}
    with launch(tmp_path, tiny_model_dir, 1, 1, AUTOSCALE_CONFIG,
                flags=["--autoscale", "1:3"]) as cluster, ThreadPoolExecutor(8) as pool:
        done: list[tuple[str, dict[str, Any]]] = []
        grown = {"now": False}

        def client(prompt: str) -> None:
            while not grown["now"]:  # streams one after another until the pool has grown
                done.append((prompt, stream(cluster, prompt, LONG)))

        clients = [pool.submit(client, p) for p in PROMPTS]
        try:
            grow_s = wait_for(lambda: pools(cluster)[1] == 3, JOIN_TIMEOUT_S, "3 decode workers")
        finally:
            grown["now"] = True
        for future in clients:
            future.result(timeout=JOIN_TIMEOUT_S)
        shrink_s = wait_for(lambda: pools(cluster) == (1, 1), JOIN_TIMEOUT_S, "1P+1D again")
        assert cluster.metric("raging_pool_desired_workers", 'role="decode"') == 1
        assert cluster.metric("raging_requests_resumed_total") == 0
        log = cluster.log("autoscaler")
    # 1 -> 3 -> 1: two started and two drained at least; on a loaded machine a lull between
    # streams may drain one early and start it again (scale_down_s is 2 s here), never more
    # drained than started.
    assert "workers from http://127.0.0.1:" in log and ", every 0.5 s" in log
    started = log.count("decode pool: started a worker")
    assert started >= 2 and log.count("decode pool: draining a worker") == started
    assert done and all(r["errors"] == [] and r["done"] for _, r in done)
    assert all(r["text"] == expected[p] for p, r in done)
    print(f"autoscale: 1 -> 3 decode workers in {grow_s:.1f} s under load, "
          f"back to 1 in {shrink_s:.1f} s after; {len(done)} streams")
