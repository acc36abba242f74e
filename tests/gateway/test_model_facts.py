"""What the gateway tells of a model: the parameter count from its architecture equals the
count of the weights it saved, the digest names its files, the sizes are Ollama's."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from engine.weights.spec import load_spec
from gateway.model_facts import model_facts


def saved_parameters(folder: Path) -> int:
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return sum(weights.get_tensor(name).numel() for name in weights.keys())  # noqa: SIM118


def test_the_count_is_the_saved_weights_count(make_tiny_model: Callable[..., Path]) -> None:
    for overrides in ({}, {"tie_word_embeddings": False}):
        folder = make_tiny_model(**overrides)
        facts = model_facts(folder, load_spec(folder), "bfloat16")
        assert facts.parameter_count == saved_parameters(folder), overrides
        assert facts.family == "llama" and facts.precision == "BF16"
        assert facts.weights_bytes == (folder / "model.safetensors").stat().st_size


def test_the_real_model_is_135m(real_model_dir: Path) -> None:
    facts = model_facts(real_model_dir, load_spec(real_model_dir), "float32")
    assert facts.parameter_size == "135M" and facts.precision == "F32"


def test_the_digest_changes_with_the_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    for path in tiny_model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    spec = load_spec(tmp_path)
    before = model_facts(tmp_path, spec, "float32").digest
    assert before.startswith("sha256:") and model_facts(tmp_path, spec, "float32").digest == before
    weights = tmp_path / "model.safetensors"
    os.utime(weights, ns=(0, weights.stat().st_mtime_ns + 1))
    assert model_facts(tmp_path, spec, "float32").digest != before


def test_an_embedding_model_without_a_head_counts_none(tiny_qwen3_embedding_dir: Path) -> None:
    facts = model_facts(tiny_qwen3_embedding_dir, load_spec(tiny_qwen3_embedding_dir), "float32")
    assert not facts.generates
    assert facts.parameter_count == saved_parameters(tiny_qwen3_embedding_dir)
