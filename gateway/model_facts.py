"""What the gateway tells of the served model beyond its name: its family, size, precision and
files, for the routes that describe a model (Ollama's /api/tags, /api/show, /api/ps)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from engine.weights.files import has_output_head
from engine.weights.spec import ModelSpec

_DTYPE_LEVELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class ModelFacts:
    spec: ModelSpec
    family: str  # config.json's model_type: llama, qwen2, ...
    dtype: str  # what the workers multiply in: bfloat16, float32, ...
    weights_bytes: int  # of the folder's weight files (the dense ones)
    digest: str  # names this copy of the model (see `model_facts`)
    modified_at: float  # when its weights were last written (Unix time)
    generates: bool = True  # False: an embedding model without an output head

    @property
    def parameter_count(self) -> int:
        """The weights' count, from the architecture: embeddings, each layer's attention,
        MLP and norms, the final norm, and the output head if it has one of its own."""
        spec = self.spec
        hidden, q_width = spec.hidden_size, spec.num_heads * spec.head_dim
        kv_width = spec.num_kv_heads * spec.head_dim
        attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
        if spec.qkv_bias:
            attention += q_width + 2 * kv_width
        if spec.qk_norm:
            attention += 2 * spec.head_dim
        layer = attention + 3 * hidden * spec.intermediate_size + 2 * hidden
        own_head = self.generates and not spec.tie_word_embeddings
        head = spec.vocab_size * hidden if own_head else 0
        return spec.vocab_size * hidden + spec.num_layers * layer + hidden + head

    @property
    def parameter_size(self) -> str:
        """The count as Ollama shows it: 135M, 1.2B."""
        count = self.parameter_count
        return f"{count / 1e6:.0f}M" if count < 1e9 else f"{count / 1e9:.1f}B"

    @property
    def precision(self) -> str:
        """The dtype as Ollama names a quantization level: BF16, F32."""
        return _DTYPE_LEVELS.get(self.dtype, self.dtype.upper())


def model_facts(folder: Path, spec: ModelSpec, dtype: str) -> ModelFacts:
    """The facts of the model in `folder`. Its digest hashes config.json and the weight
    files' names, sizes and times, not the weights themselves: that would read gigabytes at
    every start."""
    config = (folder / "config.json").read_bytes()
    weights = sorted(folder.glob("model*.safetensors"))  # not a GGUF's quant blocks too
    stats = [(path.name, path.stat()) for path in weights]
    named = [config, *(f"{name} {stat.st_size} {stat.st_mtime_ns}".encode()
                       for name, stat in stats)]
    digest = hashlib.sha256(b"\n".join(named)).hexdigest()
    return ModelFacts(spec, str(json.loads(config).get("model_type", "")), dtype,
                      sum(stat.st_size for _, stat in stats), f"sha256:{digest}",
                      max((stat.st_mtime for _, stat in stats), default=0.0),
                      has_output_head(folder, spec.tie_word_embeddings))
