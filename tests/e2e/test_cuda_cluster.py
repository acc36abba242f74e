"""A whole cluster on one GPU, KV handed over by CUDA IPC: greedy output equal to
transformers', an abort storm that leaves no block held, a killed decode worker and a killed
sender that leave the rest serving. Skipped, saying why, without a GPU and cupy."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from engine.weights.tokenizer import decode_text
from kvtransfer.cuda_ipc import cuda_problem
from tests.e2e.cluster import TEST_CONFIG, Cluster, alive, greedy_reference, launch
from tests.e2e.test_abort_storm import storm

PROBLEM = cuda_problem()
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(PROBLEM is not None, reason=f"needs a GPU and cupy: {PROBLEM}")]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "日本の首都は", "A"]
MAX_TOKENS = 12


def gpu_config(backend: str = "cuda_ipc", cuda_graphs: bool = True) -> dict[str, Any]:
    config = copy.deepcopy(TEST_CONFIG)
    config["model"] = {"dtype": "float32", "device": "cuda"}
    config["engine"] = {"cuda_graphs": cuda_graphs}
    config["kv_transfer"] = {"backend": backend, "buffer_mb": 8}
    for pool in ("prefill", "decode"):
        config[pool]["gpu_memory_fraction"] = 0.1
    return config


def completion(cluster: Cluster, prompt: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return cluster.client.post("/v1/completions", json={
        "model": cluster.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def held(cluster: Cluster, workers: list[str], timeout_s: float = 30.0) -> dict[str, float]:
    """Blocks and sequences each worker still holds, once they settle (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {f"{name} {w}": cluster.metric(name, f'worker="{w}"') for w in workers
                 for name in ("raging_kv_blocks_used", "raging_worker_running",
                              "raging_kv_in_transfer")}
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.3)


@pytest.mark.parametrize(("backend", "cuda_graphs"),
                         [("cuda_ipc", True), ("cuda_ipc", False), ("shm", True)])
def test_greedy_output_equals_transformers(backend: str, cuda_graphs: bool,
                                           tiny_model_dir: Path, tmp_path: Path) -> None:
    """Over CUDA IPC, with decode steps as CUDA graphs and without; and over shared memory
    (KV through the host), as between a GPU worker and a CPU one."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = greedy_reference(tiny_model_dir)
    with launch(tmp_path, tiny_model_dir, config=gpu_config(backend, cuda_graphs)) as cluster:
        for prompt in PROMPTS:
            expected = decode_text(tokenizer, reference(tokenizer.encode(prompt), MAX_TOKENS))
            response = completion(cluster, prompt)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected, prompt
        time.sleep(1.0)  # a heartbeat, for the counters
        labels = f'backend="{backend}",direction="send",worker="prefill-0"'
        assert cluster.metric("raging_kv_transfer_chunks_total", labels) >= len(PROMPTS)
        assert "model on cuda" in cluster.log("decode-0")


def test_an_abort_storm_on_the_gpu_leaves_no_block_held(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    with launch(tmp_path, tiny_model_dir, prefill=1, decode=1, config=gpu_config()) as cluster:
        outcomes = asyncio.run(storm(cluster.url, cluster.model))
        assert outcomes["timeout"] == 0
        state = held(cluster, ["prefill-0", "decode-0"])
        assert not any(state.values()), {k: v for k, v in state.items() if v}
        assert completion(cluster, "Hello").status_code == 200


def test_killed_workers_leave_the_rest_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A decode worker killed mid-stream, then a prefill worker (a CUDA IPC sender whose buffer
    a decode worker has open) killed mid-transfer: every request ends, the survivors serve
    greedy output as before and hold nothing once idle."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = greedy_reference(tiny_model_dir)
    expected = decode_text(tokenizer, reference(tokenizer.encode(PROMPTS[0]), MAX_TOKENS))
    with launch(tmp_path, tiny_model_dir, prefill=2, decode=2, config=gpu_config(),
                flags=["--restarts", "0"]) as cluster:  # the survivors alone serve
        pids = cluster.pids()
        for victim in ("decode-0", "prefill-0"):
            with ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(completion, cluster, f"Story {i}: once", 200)
                           for i in range(16)]
                time.sleep(0.5)
                os.kill(pids[victim], signal.SIGKILL)
                statuses = [future.result().status_code for future in futures]
            assert all(status in (200, 500, 502, 503) for status in statuses), statuses
            assert not alive(pids[victim])
            time.sleep(4.0)  # the heartbeat timeout (3 s): the gateway has let it go
            response = completion(cluster, PROMPTS[0])
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
        assert alive(pids["decode-1"]) and alive(pids["prefill-1"])
        state = held(cluster, ["prefill-1", "decode-1"])
        assert not any(state.values()), {k: v for k, v in state.items() if v}
