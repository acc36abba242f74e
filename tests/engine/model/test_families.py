"""Qwen2 (biases on q, k and v; untied embeddings), Qwen3 (each head's q and k normalized,
heads wider than hidden / heads) and Mistral (a sliding window shorter than the prompts)
through our forward pass, against transformers on tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.weights.spec import load_spec
from tests.engine.model.test_llama import assert_decode_logits_match, greedy_pair, random_prompt


@pytest.fixture(params=["qwen2", "qwen3", "mistral"])
def family_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"tiny_{request.param}_dir"))


def test_the_families_differ_from_llama_where_they_should(
        tiny_qwen2_dir: Path, tiny_qwen3_dir: Path, tiny_mistral_dir: Path) -> None:
    qwen2, qwen3 = load_spec(tiny_qwen2_dir), load_spec(tiny_qwen3_dir)
    mistral = load_spec(tiny_mistral_dir)
    assert qwen2.qkv_bias and not qwen2.tie_word_embeddings and qwen2.sliding_window is None
    assert not qwen2.qk_norm and not mistral.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.sliding_window is None
    assert qwen3.head_dim == 32 and qwen3.num_heads * qwen3.head_dim != qwen3.hidden_size
    assert mistral.sliding_window == 8 and not mistral.qkv_bias


@pytest.mark.parametrize(("family", "lengths", "steps"), [
    ("qwen2", (5, 17), 6),
    ("qwen3", (5, 17), 6),
    ("mistral", (5, 8, 21), 8),  # the first outgrows the window of 8 on the way
])
def test_logits_match_transformers_prefill_and_decode(
        family: str, lengths: tuple[int, ...], steps: int, request: pytest.FixtureRequest) -> None:
    folder = Path(request.getfixturevalue(f"tiny_{family}_dir"))
    assert_decode_logits_match(folder, lengths, steps)


def test_greedy_tokens_equal_transformers_generate_after_a_chunked_prompt(
        family_dir: Path) -> None:
    ours, theirs = greedy_pair(family_dir, random_prompt(19, seed=4), 12, chunks=(6,))
    assert ours == theirs
