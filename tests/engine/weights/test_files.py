"""A model folder's files read without loading a tensor: weight names from safetensors headers,
bare decoders' names, whether the model has an output head."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.weights.files import (
    EMBED,
    LM_HEAD,
    QUANT_FILE,
    WEIGHTS_FILE,
    causal_name,
    has_output_head,
    is_bare,
    tensor_names,
)


def test_tensor_names_are_the_header_s(tmp_path: Path) -> None:
    save_file({"a.weight": torch.zeros(2), "b.bias": torch.ones(3)}, tmp_path / "x.safetensors",
              metadata={"format": "pt"})
    assert tensor_names(tmp_path / "x.safetensors") == {"a.weight", "b.bias"}


def test_a_bare_decoder_s_names_become_a_causal_lm_s() -> None:
    names = {"embed_tokens.weight", "layers.0.mlp.up_proj.weight", "norm.weight"}
    assert is_bare(names)
    assert {causal_name(name, True) for name in names} == {
        EMBED, "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    assert causal_name(LM_HEAD, True) == LM_HEAD
    assert not is_bare({EMBED, "model.norm.weight"})
    assert causal_name(EMBED, False) == EMBED


def test_output_heads(tiny_model_dir: Path, tiny_qwen3_dir: Path,
                      tiny_qwen3_embedding_dir: Path) -> None:
    assert has_output_head(tiny_model_dir, tied=True)
    assert has_output_head(tiny_qwen3_dir, tied=False)
    assert not has_output_head(tiny_qwen3_embedding_dir, tied=False)
    assert has_output_head(tiny_qwen3_embedding_dir, tied=True)


def test_a_head_kept_as_quant_blocks_counts(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny_qwen3_dir / WEIGHTS_FILE)
    head = tensors.pop(LM_HEAD)
    save_file(tensors, tmp_path / WEIGHTS_FILE)
    assert not has_output_head(tmp_path, tied=False)
    save_file({LM_HEAD: head}, tmp_path / QUANT_FILE)
    assert has_output_head(tmp_path, tied=False)


def test_a_folder_without_weights_generates(tmp_path: Path) -> None:
    """A simulated model's folder: a config and a tokenizer, no weights."""
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert has_output_head(tmp_path, tied=False)
