"""Tensor-parallel workers in real clusters: KV handed between workers split over different
numbers of processes, and a worker losing one of its ranks."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import TEST_CONFIG, Cluster, greedy_reference, launch

pytestmark = pytest.mark.e2e
Reference = Callable[[list[int], int], list[int]]


def split_config(prefill_tp: int, decode_tp: int) -> dict[str, Any]:
    return {**TEST_CONFIG, "prefill": {**TEST_CONFIG["prefill"], "tp": prefill_tp},
            "decode": {**TEST_CONFIG["decode"], "tp": decode_tp}}


def complete(cluster: Cluster, prompt: str | list[int], max_tokens: int = 12) -> str:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    response = cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def ranks_of(pid: int) -> list[int]:
    """The PIDs of the tensor-parallel ranks worker `pid` started."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"engine.tp" in cmdline:
                children.append(int(entry.name))
    return children


def assert_greedy_between_splits(cluster: Cluster, reference: Reference) -> None:
    """Prompts of 3, 20 and 57 tokens (one block, several, a partial last) get transformers'
    greedy continuation."""
    for prompt in ([5 + 7 * i + j for j in range(n)] for i, n in enumerate((3, 20, 57))):
        text = cluster.client.post("/detokenize", json={
            "model": cluster.model, "tokens": reference(prompt, 12)}).json()["prompt"]
        assert complete(cluster, prompt) == text


def test_kv_moves_from_a_worker_to_one_split_in_two(tiny_model_dir: Path, tmp_path: Path
                                                      ) -> None:
    """Prefill on one process, decode split over two (the other way round: the test below)."""
    with launch(tmp_path / "run", tiny_model_dir, config=split_config(1, 2)) as cluster:
        assert len(ranks_of(cluster.pids()["decode-0"])) == 1
        assert_greedy_between_splits(cluster, greedy_reference(tiny_model_dir))


def test_a_worker_that_loses_a_rank_ends_and_its_requests_finish_elsewhere(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Prefill split over two processes (each of two workers), decode on one: KV moves between
    them; then prefill-0 loses its rank mid-request."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = greedy_reference(tiny_model_dir)
    prompts = [f"Request number {i} says" for i in range(8)]
    with launch(tmp_path / "run", tiny_model_dir, prefill=2,
                config=split_config(2, 1)) as cluster:
        assert_greedy_between_splits(cluster, reference)
        worker = cluster.pids()["prefill-0"]
        (rank,) = ranks_of(worker)
        os.kill(worker, signal.SIGSTOP)  # requests routed to it wait there
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, cluster, prompt, 8) for prompt in prompts]
            time.sleep(1.0)
            os.kill(rank, signal.SIGKILL)
            os.kill(worker, signal.SIGCONT)  # it finds its rank gone
            texts = [future.result(timeout=60) for future in futures]
        for prompt, text in zip(prompts, texts, strict=True):
            assert text == decode_text(tokenizer, reference(tokenizer.encode(prompt), 8))
        assert cluster.metric("raging_requests_resumed_total") >= 1
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and b"engine" in Path(
                f"/proc/{worker}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the worker lived on without its rank"
            time.sleep(0.1)
    log = (tmp_path / "run" / "prefill-0.log").read_text()
    assert "tensor-parallel rank 1" in log and "ended with status -9" in log
