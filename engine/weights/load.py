"""Load a model folder's safetensors weights, memory-mapped: exactly the files the model names
(its index's shards, else `model.safetensors`), never another safetensors file beside them
(the quant blocks file holds tensors of the same names)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.weights.files import EMBED, LM_HEAD, causal_name, is_bare, weight_files


def load_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors by their Hugging Face names, cast to `dtype`.

    Tensors already in `dtype` stay views of the memory-mapped file, so processes loading the
    same folder share its page cache. A missing `lm_head.weight` (tied embeddings) is the
    embedding tensor itself, and so is a missing one of a checkpoint that does not tie them
    but was saved from the decoder alone (an embedding model's: its names are given as a
    causal LM's). A folder prepared from a GGUF holds only its weights that are not quant
    blocks (engine.weights.gguf).
    """
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        weights.update(_load_file(path, dtype))
    bare = is_bare(set(weights))
    weights = {causal_name(name, bare): tensor for name, tensor in weights.items()}
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
