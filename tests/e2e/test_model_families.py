"""Model families beyond SmolLM's Llama end to end: tiny random Qwen2, Qwen3 (its q and k
normalized per head), Mistral (its sliding window shorter than the prompts) and Llama 3 (its
RoPE scaling's original length shorter than the prompts), each served by a real 1P+1D
cluster, its KV handed from prefill to decode, greedy streams equal to transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.cluster import greedy_reference, launch
from tests.reference import last_hidden_state

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


def test_an_embedding_model_saved_without_its_head_serves_embeddings(
        tiny_qwen3_embedding_dir: Path, tmp_path: Path) -> None:
    """Qwen3-Embedding's checkpoints hold the decoder alone (names without `model.`; the 8B's
    no output head, untied): its prompts come back as transformers' last hidden state,
    normalized; text is refused."""
    prompts = [[5 + 3 * i + j for j in range(n)] for i, n in enumerate((1, 16, 37))]
    with launch(tmp_path / "run", tiny_qwen3_embedding_dir, prefill=1, decode=1) as cluster:
        body = {"model": cluster.model, "input": prompts}
        reply = cluster.client.post("/v1/embeddings", json=body)
        assert reply.status_code == 200, reply.text
        for prompt, item in zip(prompts, reply.json()["data"], strict=True):
            expected = last_hidden_state(tiny_qwen3_embedding_dir, prompt)
            torch.testing.assert_close(torch.tensor(item["embedding"]),
                                       expected / expected.norm(), atol=1e-4, rtol=1e-4)
        chat = {"model": cluster.model, "messages": [{"role": "user", "content": "Hi"}]}
        refused = cluster.client.post("/v1/chat/completions", json=chat)
        assert refused.status_code == 400 and "/v1/embeddings" in refused.text
