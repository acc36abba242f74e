"""Each KV backend end to end, with prefill and decode paging their caches differently."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner
from engine.weights.spec import load_spec
from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import TEST_CONFIG, Cluster, greedy_reference, launch

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "日本の首都は", "A"]
MAX_TOKENS = 12


def config_for(backend: str) -> dict:
    config = copy.deepcopy(TEST_CONFIG)
    config["decode"]["block_size"] = 32  # prefill pages by 16: KV moves per token
    config["kv_transfer"] = {"backend": backend, "buffer_mb": 4}
    return config


def completion_ids(cluster: Cluster, tokenizer: PreTrainedTokenizerBase, prompt: str
                   ) -> list[int]:
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
            expected = decode_text(tokenizer, reference(tokenizer.encode(prompt), MAX_TOKENS))
            got = completion_ids(cluster, tokenizer, prompt)
            assert decode_text(tokenizer, got) == expected, prompt
        segments = list(Path("/dev/shm").glob(f"raging-kv-{cluster.pids()['prefill-0']}-*"))
        assert len(segments) == (1 if backend == "shm" else 0)
        chunks = len(PROMPTS)  # a tiny model's KV: both layers fit one chunk
        settled(lambda: transfer_metric(cluster, "chunks", "any", "receive", "decode-0") == chunks
                and transfer_metric(cluster, "chunks", backend, "send", "prefill-0") == chunks)
        sent = transfer_metric(cluster, "bytes", backend, "send", "prefill-0")
        assert sent > 0 and sent == transfer_metric(cluster, "bytes", "any", "receive", "decode-0")
        assert transfer_metric(cluster, "failures", backend, "send", "prefill-0") == 0
    assert not any(segment.exists() for segment in segments)  # removed when prefill stopped


def greedy_in_process(model_dir: Path, dtype: torch.dtype, prompt_ids: list[int],
                      max_tokens: int) -> list[int]:
    """Greedy tokens of our own runner in this process: one prefill, then one token a step."""
    runner = ModelRunner(model_dir, num_blocks=8, block_size=16, dtype=dtype)
    table = runner.allocator.allocate(blocks_needed(len(prompt_ids) + max_tokens, 16))
    tokens = [int(runner.forward(ForwardBatch([prompt_ids], [0], [table]))[0].argmax())]
    while len(tokens) < max_tokens:
        position = len(prompt_ids) + len(tokens) - 1
        step = ForwardBatch([[tokens[-1]]], [position], [table])
        tokens.append(int(runner.forward(step)[0].argmax()))
    return tokens


def test_bf16_kv_crosses_intact(tiny_model_dir: Path, tmp_path: Path) -> None:
    """In bf16 (the default on CPUs with bf16 instructions) the cluster's greedy tokens are
    those of one process running the same engine: the KV arrives bit for bit."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = config_for("zmq")
    config["model"] = {"dtype": "bfloat16"}
    with launch(tmp_path, tiny_model_dir, prefill=1, decode=1, config=config) as cluster:
        for prompt in PROMPTS:
            expected = greedy_in_process(tiny_model_dir, torch.bfloat16,
                                         tokenizer.encode(prompt), MAX_TOKENS)
            got = completion_ids(cluster, tokenizer, prompt)
            assert decode_text(tokenizer, got) == decode_text(tokenizer, expected), prompt
        settled(lambda: transfer_metric(cluster, "chunks", "zmq", "send", "prefill-0")
                == len(PROMPTS))
        sent = transfer_metric(cluster, "bytes", "zmq", "send", "prefill-0")
    spec = load_spec(tiny_model_dir)
    prompt_tokens = sum(len(tokenizer.encode(prompt)) for prompt in PROMPTS)
    assert sent == prompt_tokens * spec.kv_bytes_per_token(torch.bfloat16)
