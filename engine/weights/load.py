"""Load a model folder's safetensors weights, memory-mapped: exactly the files the model names
(its index's shards, else `model.safetensors`), never another safetensors file beside them
(the quant blocks file holds tensors of the same names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.weights.files import WEIGHTS_FILE, WEIGHTS_INDEX

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def weight_files(folder: Path) -> list[Path]:
    """The files holding the model's weights, as Hugging Face names them: the shards of
    `model.safetensors.index.json`, else `model.safetensors`."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    if not (folder / WEIGHTS_FILE).exists():
        raise ValueError(f"{folder} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}")
    return [folder / WEIGHTS_FILE]


def load_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors by their Hugging Face names, cast to `dtype`.

    Tensors already in `dtype` stay views of the memory-mapped file, so processes loading the
    same folder share its page cache. A missing `lm_head.weight` (tied embeddings) is the
    embedding tensor itself. A folder prepared from a GGUF holds only its weights that are
    not quant blocks (engine.weights.gguf).
    """
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        weights.update(_load_file(path, dtype))
    if EMBED in weights:
        weights.setdefault(LM_HEAD, weights[EMBED])
    return weights


def _load_file(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor = f.get_tensor(name)
            tensors[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return tensors
