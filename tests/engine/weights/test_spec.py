"""Reading ModelSpec from config.json / generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.weights.spec import load_spec

BASE_CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
}


def write_folder(tmp_path: Path, generation: dict[str, Any] | None = None, **config: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, **config}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_real_model_spec(real_model_dir: Path) -> None:
    spec = load_spec(real_model_dir)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert spec.head_dim == 64 and spec.vocab_size == 49152 and spec.intermediate_size == 1536
    assert spec.rope_theta == 100000.0 and spec.rope_scaling is None
    assert spec.tie_word_embeddings and spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert spec.max_position_embeddings == 8192 and spec.name == "SmolLM2-135M-Instruct"
    assert spec.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    assert spec.kv_bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_defaults_for_missing_keys(tmp_path: Path) -> None:
    spec = load_spec(write_folder(tmp_path))
    assert spec.head_dim == 8 and spec.rope_theta == 10000.0 and spec.rope_scaling is None
    assert not spec.tie_word_embeddings


def test_legacy_rope_keys(tmp_path: Path) -> None:
    spec = load_spec(
        write_folder(tmp_path, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    )
    assert spec.rope_theta == 5e5
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_llama3_rope_parameters_default_original_length(tmp_path: Path) -> None:
    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    spec = load_spec(write_folder(tmp_path, rope_parameters=params))
    assert spec.rope_theta == 5e5
    assert spec.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    spec = load_spec(write_folder(tmp_path, generation={"eos_token_id": [7, 2, 9]}))
    assert spec.eos_token_ids == (2, 7, 9)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "gpt2"},
        {"attention_bias": True},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
    ],
)
def test_unsupported_configs_are_value_errors(tmp_path: Path, config: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        load_spec(write_folder(tmp_path, **config))


def test_missing_config_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_spec(tmp_path)


def test_unsupported_architectures_are_named_with_the_supported_ones(tmp_path: Path) -> None:
    for config, says in (({"model_type": "gemma"},
                          "'gemma' is not supported: llama, mistral, qwen2"),
                         ({"model_type": "qwen2", "use_sliding_window": True},
                          "sliding-window")):
        write_folder(tmp_path, **config)
        with pytest.raises(ValueError, match=says):
            load_spec(tmp_path)


def test_a_mistral_window_is_read_and_other_families_have_none(tmp_path: Path) -> None:
    assert load_spec(write_folder(tmp_path, model_type="mistral",
                                  sliding_window=4096)).sliding_window == 4096
    assert load_spec(write_folder(tmp_path, model_type="mistral",
                                  sliding_window=None)).sliding_window is None
    assert load_spec(write_folder(tmp_path, sliding_window=4096)).sliding_window is None


def test_dynamic_rope_stretches_the_context_by_its_factor(tmp_path: Path) -> None:
    spec = load_spec(write_folder(tmp_path, rope_scaling={"type": "dynamic", "factor": 4.0}))
    assert spec.max_position_embeddings == 2048
    assert spec.rope_scaling == {"rope_type": "dynamic", "factor": 4.0,
                                 "original_max_position_embeddings": 512}
