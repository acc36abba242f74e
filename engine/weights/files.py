"""The files of a model folder: Hugging Face's weights (and their index), and those raging
adds to a folder it prepared. Nothing here loads a tensor (the gateway reads names here)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded model's: weight name -> shard file
QUANT_FILE = "quant_blocks.safetensors"  # the GGUF's quant blocks (engine.weights.quant_blocks)
QUANT_ROWS_FILE = "quant_rows.json"  # quant row counts measured per machine (quant_rows)
PREPARED_FILE = "prepared.json"  # the configs `python -m engine` prepared it for (engine.prepared)
READY_MARKER = ".raging-ready"  # written last: the prepared folder is whole

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
DECODER_PREFIX = "model."  # what a causal LM's names add to its decoder's


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


def causal_name(name: str, bare: bool) -> str:
    """A weight's name as a causal LM's checkpoint gives it. `bare`: the checkpoint was saved
    from the decoder alone (`embed_tokens.weight`, `layers.0...`), as embedding models such
    as Qwen3-Embedding are."""
    return DECODER_PREFIX + name if bare and name != LM_HEAD else name


def is_bare(names: set[str]) -> bool:
    """Whether weight `names` are a bare decoder's (see `causal_name`)."""
    return EMBED not in names and EMBED.removeprefix(DECODER_PREFIX) in names


def has_output_head(folder: Path, tied: bool) -> bool:
    """Whether the model in `folder` can generate text: it has an output head, in its weights
    or its quant blocks, or ties it to its embeddings. An embedding model saved from its
    decoder alone without tying (Qwen3-Embedding-8B) has none. A folder without weight files
    (a simulated model's) generates."""
    if tied or not any((Path(folder) / name).exists() for name in (WEIGHTS_FILE, WEIGHTS_INDEX)):
        return True
    names = {name for path in weight_files(folder) for name in tensor_names(path)}
    quant = Path(folder) / QUANT_FILE
    if quant.exists():
        names |= tensor_names(quant)
    return LM_HEAD in names


def tensor_names(path: Path) -> set[str]:
    """The names of the tensors in a safetensors file, from its header (none is read)."""
    with safe_open(str(path), framework="numpy") as file:
        return set(file.keys())
