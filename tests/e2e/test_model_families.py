"""Model families beyond SmolLM's Llama end to end: tiny random Qwen2, Qwen3 (its q and k
normalized per head), Mistral (its sliding window shorter than the prompts) and Llama 3 (its
RoPE scaling's original length shorter than the prompts), each served by a real 1P+1D
cluster, its KV handed from prefill to decode, greedy streams equal to transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import greedy_reference, launch

pytestmark = pytest.mark.e2e

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.fixture(params=["qwen2", "qwen3", "mistral", "llama3"])
def family_dir(request: pytest.FixtureRequest) -> Path:
    if request.param == "llama3":
        make = request.getfixturevalue("make_tiny_model")
        return Path(make(rope_parameters=LLAMA3_ROPE))
    return Path(request.getfixturevalue(f"tiny_{request.param}_dir"))


def test_a_cluster_streams_what_transformers_generates(family_dir: Path, tmp_path: Path) -> None:
    reference = greedy_reference(family_dir)
    prompts = [[5 + 7 * i + j for j in range(n)] for i, n in enumerate((3, 17, 40, 64))]
    with launch(tmp_path / "run", family_dir, prefill=1, decode=1) as cluster:
        assert cluster.metric("raging_workers", 'role="decode"') == 1
        for prompt in prompts:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1}
            answer = cluster.client.post("/v1/completions", json=body).json()
            assert len(answer["choices"][0]["logprobs"]["tokens"]) == 16
            expected = reference(prompt, 16)
            text = cluster.client.post("/detokenize", json={"model": cluster.model,
                                                            "tokens": expected}).json()
            assert answer["choices"][0]["text"] == text["prompt"]
