"""Each KV backend end to end, with prefill and decode paging their caches differently."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.e2e.cluster import TEST_CONFIG, Cluster, greedy_reference, launch

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "日本の首都は", "A"]
MAX_TOKENS = 12


def config_for(backend: str) -> dict:
    config = copy.deepcopy(TEST_CONFIG)
    config["decode"]["block_size"] = 32  # prefill pages by 16: KV moves per token
    config["kv_transfer"] = {"backend": backend, "buffer_mb": 4}
    return config


def completion_ids(cluster: Cluster, tokenizer: AutoTokenizer, prompt: str) -> list[int]:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    response = cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return tokenizer.encode(choice["text"], add_special_tokens=False)


def transfer_metric(cluster: Cluster, name: str, backend: str, direction: str, worker: str,
                    ) -> float:
    labels = f'backend="{backend}",direction="{direction}",worker="{worker}"'
    return cluster.metric(f"raging_kv_transfer_{name}_total", labels)


def settled(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for `condition` (metrics follow the workers' heartbeats, every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except KeyError:  # not reported yet
            pass
        assert time.monotonic() < deadline, "the metrics never showed the transfers"
        time.sleep(0.2)


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_greedy_output_matches_transformers_over_each_backend(
    backend: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference: Callable[[list[int], int], list[int]] = greedy_reference(tiny_model_dir)
    with launch(tmp_path, tiny_model_dir, prefill=1, decode=1,
                config=config_for(backend)) as cluster:
        for prompt in PROMPTS:
            expected = tokenizer.decode(reference(tokenizer.encode(prompt), MAX_TOKENS))
            got = completion_ids(cluster, tokenizer, prompt)
            assert tokenizer.decode(got) == expected, prompt
        segments = list(Path("/dev/shm").glob(f"raging-kv-{cluster.pids()['prefill-0']}-*"))
        assert len(segments) == (1 if backend == "shm" else 0)
        chunks = len(PROMPTS)  # a tiny model's KV: both layers fit one chunk
        settled(lambda: transfer_metric(cluster, "chunks", "any", "receive", "decode-0") == chunks
                and transfer_metric(cluster, "chunks", backend, "send", "prefill-0") == chunks)
        sent = transfer_metric(cluster, "bytes", backend, "send", "prefill-0")
        assert sent > 0 and sent == transfer_metric(cluster, "bytes", "any", "receive", "decode-0")
        assert transfer_metric(cluster, "failures", backend, "send", "prefill-0") == 0
    assert not any(segment.exists() for segment in segments)  # removed when prefill stopped
