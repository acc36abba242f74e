"""Model families other than Llama end to end: a tiny random Qwen2 served by a real 1P+1D
cluster, its KV handed from prefill to decode, greedy streams equal to transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.cluster import greedy_reference, launch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def qwen2_reference(tiny_qwen2_dir: Path) -> Callable[[list[int], int], list[int]]:
    return greedy_reference(tiny_qwen2_dir)


def test_a_qwen2_cluster_streams_what_transformers_generates(
        tiny_qwen2_dir: Path, qwen2_reference: Callable[[list[int], int], list[int]],
        tmp_path: Path) -> None:
    prompts = [[5 + 7 * i + j for j in range(n)] for i, n in enumerate((3, 17, 40, 64))]
    with launch(tmp_path / "run", tiny_qwen2_dir, prefill=1, decode=1) as cluster:
        assert cluster.metric("raging_workers", 'role="decode"') == 1
        for prompt in prompts:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1}
            answer = cluster.client.post("/v1/completions", json=body).json()
            tokens = answer["choices"][0]["logprobs"]["tokens"]
            assert len(tokens) == 16
            expected = qwen2_reference(prompt, 16)
            text = cluster.client.post("/detokenize", json={"model": cluster.model,
                                                            "tokens": expected}).json()
            assert answer["choices"][0]["text"] == text["prompt"]
