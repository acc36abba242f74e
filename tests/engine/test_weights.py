"""Loading safetensors: tied embeddings, zero-copy memory maps, dtype casts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.weights import EMBED, LM_HEAD, load_weights


def mapped_files(tensor: torch.Tensor) -> list[str]:
    """Paths of the memory mappings that hold the tensor's data (Linux)."""
    address = tensor.data_ptr()
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high and len(fields) > 5:
                found.append(fields[5])
    return found


def test_tied_lm_head_is_the_embedding(tiny_model_dir: Path) -> None:
    weights = load_weights(tiny_model_dir, torch.float32)
    assert weights[LM_HEAD] is weights[EMBED]
    assert weights[EMBED].shape == (49152, 64)
    assert len([name for name in weights if name.startswith("model.layers.0.")]) == 9


def test_same_dtype_tensors_are_views_of_the_file(real_model_dir: Path) -> None:
    weights = load_weights(real_model_dir, torch.float32)
    for name in (EMBED, "model.layers.7.mlp.down_proj.weight"):
        assert mapped_files(weights[name]) == [str(real_model_dir / "model.safetensors")]


def test_other_dtype_is_cast(tiny_model_dir: Path) -> None:
    fp32 = load_weights(tiny_model_dir, torch.float32)
    bf16 = load_weights(tiny_model_dir, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert torch.equal(bf16[EMBED], fp32[EMBED].to(torch.bfloat16))


def test_folder_without_safetensors_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_weights(tmp_path, torch.float32)
