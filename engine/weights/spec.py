"""The shape of a Llama-family model, read from its Hugging Face config files, and the KV layout
fingerprint two workers must share to exchange KV. No torch here: the gateway reads it too."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model's architecture and special tokens.

    `rope_scaling` is None for plain RoPE, else a dict with "rope_type" ("dynamic", "linear" or
    "llama3") and that type's parameters, as transformers names them. A dynamic one stretches
    the context `factor` times: `max_position_embeddings` is the stretched length, its
    "original_max_position_embeddings" the config's.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    qk_norm: bool = False  # each head's q and k are RMS-normalized before RoPE (Qwen3)
    sliding_window: int | None = None  # a query sees only this many latest keys (Mistral)

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def load_spec(folder: Path) -> ModelSpec:
    """Read `config.json` (and `generation_config.json` if present) from a model folder."""
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    if config is None:
        raise ValueError(f"{folder} has no config.json")
    _check_supported(config)
    generation = _read_json(folder / "generation_config.json") or {}
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = _rope_settings(config)
    max_positions = config.get("max_position_embeddings", 2048)
    if rope_scaling is not None and rope_scaling["rope_type"] == "dynamic":
        max_positions = int(max_positions * rope_scaling["factor"])
    return ModelSpec(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or _default_head_dim(config),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(config, generation),
        name=folder.name,
        qkv_bias=config["model_type"] == "qwen2",
        qk_norm=config["model_type"] == "qwen3",
        sliding_window=config.get("sliding_window") if config["model_type"] == "mistral" else None,
    )


def _default_head_dim(config: dict[str, Any]) -> int:
    """A head's width where the config leaves it out: transformers' default (Qwen3's 128)."""
    if config["model_type"] == "qwen3":
        return 128
    return int(config["hidden_size"] // config["num_attention_heads"])


def kv_fingerprint(spec: ModelSpec, dtype: str) -> str:
    """What two workers must agree on to exchange KV (block size may differ: KV moves per token)."""
    return (f"{spec.name}|{dtype}|layers={spec.num_layers}|kv_heads={spec.num_kv_heads}"
            f"|head_dim={spec.head_dim}")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with path.open() as f:
        return json.load(f)


def _check_supported(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not supported")
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window (Qwen2's sliding-window attention on some layers) "
                         "is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported")


def _rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or the legacy keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if rope_type == "dynamic":  # transformers stretches the config's length, whatever else says
        params["original_max_position_embeddings"] = config["max_position_embeddings"]
    return theta, {"rope_type": rope_type, **params}


def _eos_token_ids(config: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)
