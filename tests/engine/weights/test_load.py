"""Loading safetensors: exactly the model's files, tied embeddings, zero-copy memory maps, dtype
casts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.weights.files import EMBED, LM_HEAD, WEIGHTS_INDEX, weight_files
from engine.weights.load import load_weights


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


def test_only_the_weights_file_is_read_beside_a_quant_file(quant_model_dir: Path) -> None:
    """The quant file holds tensors of the same names: it must never be read as weights."""
    assert weight_files(quant_model_dir) == [quant_model_dir / "model.safetensors"]
    weights = load_weights(quant_model_dir, torch.float32)
    for name in (EMBED, "model.layers.1.self_attn.q_proj.weight"):
        assert weights[name].dtype == torch.float32
        assert mapped_files(weights[name]) == [str(quant_model_dir / "model.safetensors")]


def test_sharded_weights_are_the_files_their_index_names(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5],
              "model-00002-of-00002.safetensors": names[5:]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / shard)
    save_file({EMBED: torch.zeros(2, 2)}, tmp_path / "stray.safetensors")  # named by nobody
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (tmp_path / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert weight_files(tmp_path) == [tmp_path / shard for shard in sorted(shards)]
    weights = load_weights(tmp_path, torch.float32)
    assert torch.equal(weights[EMBED], tensors[EMBED])
    assert set(weights) == {*names, LM_HEAD}



def test_a_bare_decoder_loads_under_a_causal_lm_s_names(tiny_qwen3_dir: Path,
                                                        tiny_qwen3_embedding_dir: Path) -> None:
    """An embedding model saved from its decoder alone (Qwen3-Embedding's): the same tensors
    under the names of the causal LM it came from, the embeddings standing for the head."""
    causal = load_weights(tiny_qwen3_dir, torch.float32)
    bare = load_weights(tiny_qwen3_embedding_dir, torch.float32)
    assert set(bare) == set(causal)
    assert bare[LM_HEAD] is bare[EMBED]
    for name in causal.keys() - {LM_HEAD}:
        assert torch.equal(bare[name], causal[name]), name
