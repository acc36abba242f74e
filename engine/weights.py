"""Load a model folder's safetensors weights, memory-mapped."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def load_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of `folder/*.safetensors` by their Hugging Face names, cast to `dtype`.

    Tensors already in `dtype` stay views of the memory-mapped file, so processes loading the
    same folder share its page cache. A missing `lm_head.weight` (tied embeddings) is the
    embedding tensor itself.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(_load_file(path, dtype))
    if EMBED not in weights:
        raise ValueError(f"{folder} has no {EMBED}")
    weights.setdefault(LM_HEAD, weights[EMBED])
    return weights


def _load_file(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor = f.get_tensor(name)
            tensors[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return tensors
