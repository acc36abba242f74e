"""A GGUF file served directly (`--model path/to/file.gguf`): prepared once into a folder of
the cache, with its config, tokenizer and chat template read as transformers reads them, and its
quantized matrices as the model's quant blocks, the only copy of those weights: Q4_1 and Q8_0 as
they are, the other types in one of those two formats (engine.weights.gguf_blocks). Only the rest
(norms, biases, F32/F16/BF16 matrices) is written out dense, in fp32, so a model whose dense copy
would not fit in memory still loads (engine.weights.choice).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from engine.weights.files import EMBED, LM_HEAD, QUANT_FILE, READY_MARKER, WEIGHTS_FILE
from engine.weights.gguf_blocks import conversion, quant_blocks_of
from engine.weights.rope_scaling import llama3_scaling
from engine.weights.spec import SUPPORTED_MODEL_TYPES

PREPARATION = 2  # counts the changes to what a prepared folder holds
ROPE_FACTORS = "rope_freqs.weight"  # llama.cpp's Llama 3 rope scaling: a divisor per frequency
_TOP_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": "model.norm.weight",
              "output.weight": LM_HEAD}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3's
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def prepared_folder(path: Path, cache_dir: Path) -> Path:
    """The cache folder `path` is prepared into: named after the file (the model's name, as
    served), inside one named after its place, size and time of change, and the way it is
    prepared, so that a file replaced under the same name, or a new way, prepares it anew."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{PREPARATION}".encode()
    return cache_dir / "gguf" / hashlib.sha256(key).hexdigest()[:16] / path.stem


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor of a Llama-family model."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_PARTS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    return f"model.layers.{match[1]}.{_LAYER_PARTS[match[2]]}.{match[3]}"


def prepare_gguf(path: Path, target: Path) -> None:
    """Prepare the folder `target` from the GGUF file `path` (see the module's docstring)."""
    start = time.monotonic()
    reader = GGUFReader(path)
    architecture = _architecture(reader)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    rope_factors = tensors.pop(ROPE_FACTORS, None)
    _write_config_and_tokenizer(path, staging, tied="output.weight" not in tensors,
                                rope_factors=None if rope_factors is None else
                                np.asarray(rope_factors.data, np.float64),
                                head_dim=_head_dim(reader, architecture))
    heads = _heads(reader, architecture)
    dense, quant, bits = {}, {}, {}
    for tensor in tqdm(tensors.values(), desc=f"reading {path.name}", unit="tensor"):
        name, converted = hf_name(tensor.name), quant_blocks_of(tensor.data,
                                                                tensor.tensor_type)
        data = _dense(tensor) if converted is None else converted[0]
        if architecture == "llama":
            data = _unpermuted(data, tensor.name, heads)
        if converted is None:
            dense[name] = data
        else:
            quant[name], bits[name] = data, str(converted[1])
    save_file(dense, staging / WEIGHTS_FILE, metadata={"format": "pt"})
    save_file(quant, staging / QUANT_FILE, metadata={"format": "pt", **bits})
    kinds = Counter(conversion(tensor.tensor_type) for tensor in tensors.values()
                    if len(tensor.shape) > 1)
    (staging / READY_MARKER).write_text(
        f"prepared from {path} in {time.monotonic() - start:.1f}s\n"
        + "".join(f"{kind} ({count} matrices)\n" for kind, count in sorted(kinds.items())))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"GGUF architecture {architecture!r} is not supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return str(architecture)


def _heads(reader: GGUFReader, architecture: str) -> dict[str, int]:
    """Query and KV head counts, by the GGUF name part of the matrices they split."""
    def count(key: str) -> int:
        field = reader.fields.get(f"{architecture}.attention.{key}")
        if field is None:
            raise ValueError(f"the GGUF has no {architecture}.attention.{key}")
        return int(field.contents())

    heads = count("head_count")
    kv_heads = count("head_count_kv") if f"{architecture}.attention.head_count_kv" in \
        reader.fields else heads
    return {"attn_q": heads, "attn_k": kv_heads}


def _head_dim(reader: GGUFReader, architecture: str) -> int | None:
    """A head's width, where the file says it (`attention.key_length`: Qwen3's heads are
    wider than hidden / heads)."""
    field = reader.fields.get(f"{architecture}.attention.key_length")
    return None if field is None else int(field.contents())


def _write_config_and_tokenizer(path: Path, folder: Path, tied: bool,
                                rope_factors: np.ndarray | None, head_dim: int | None) -> None:
    """config.json, generation_config.json, the tokenizer and its chat template, as
    transformers reads them from the GGUF's metadata (no tensor is read); with Llama 3's rope
    scaling where the file has `rope_factors`, and the `head_dim` it gives (both of which
    transformers leaves out)."""
    # Imported here: transformers is slow to import, and only preparing needs it.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(folder)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.tie_word_embeddings = tied
    config.dtype = "float32"
    if head_dim is not None:
        config.head_dim = head_dim
    theta = config.rope_parameters["rope_theta"]
    scaling = None if rope_factors is None else llama3_scaling(rope_factors, theta,
                                                               config.head_dim)
    if scaling is not None:
        config.rope_parameters = {"rope_theta": theta, **scaling}
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)


def _dense(tensor: ReaderTensor) -> np.ndarray:
    """A vector, or a matrix of a dense type, in fp32, in its HF shape."""
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return np.ascontiguousarray(values)


def _unpermuted(data: np.ndarray, gguf_name: str, heads: dict[str, int]) -> np.ndarray:
    """`data` with the rows of q and k back in Hugging Face's order: llama.cpp's converter
    interleaves each head's two rotary halves for a "llama" GGUF. Rows move whole, so quant
    blocks move as they are."""
    part = _LAYER_NAME.fullmatch(gguf_name)
    if part is None or part[2] not in heads or part[3] != "weight":
        return data
    count = heads[part[2]]
    pairs = data.reshape(count, data.shape[0] // count // 2, 2, *data.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(data.shape))
