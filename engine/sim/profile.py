"""A simulated model's profile: its shape and its step times, as `configs/sim/NAME.yaml` holds
them. Fitted from measured steps (`python -m bench calibrate`), never made up: `source` says
on what and when, `fit_error` how far the fit is from what was measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core.config import from_mapping
from engine.model.batch import ForwardBatch

PROFILES_DIR = Path(__file__).resolve().parents[2] / "configs" / "sim"


@dataclass(frozen=True)
class Latency:
    """A step's time in ms. The prefill part is summed over the sequences that add more than
    one token, the decode part over those that add one (a mixed step pays both)."""

    prefill_ms: float = 0.0  # a
    prefill_ms_per_token: float = 0.0  # b
    prefill_ms_per_token_context: float = 0.0  # c: per new token and per token it attends to
    decode_ms: float = 0.0  # d
    decode_ms_per_sequence: float = 0.0  # e
    decode_ms_per_context_token: float = 0.0  # f: per token of every sequence's context

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 0:
            raise ValueError(f"a step time's terms cannot be negative: {self}")

    def prefill_s(self, tokens: int, token_contexts: int) -> float:
        """Prefill of `tokens` new tokens attending to `token_contexts` keys in all."""
        return (self.prefill_ms + self.prefill_ms_per_token * tokens
                + self.prefill_ms_per_token_context * token_contexts) / 1e3

    def decode_s(self, batch: int, contexts: int) -> float:
        """A decode step of `batch` sequences whose contexts hold `contexts` tokens in all."""
        return (self.decode_ms + self.decode_ms_per_sequence * batch
                + self.decode_ms_per_context_token * contexts) / 1e3

    def step_s(self, batch: ForwardBatch) -> float:
        """The time of one forward pass over `batch`."""
        tokens = token_contexts = sequences = contexts = 0
        for new, start in zip(batch.token_ids, batch.start_positions, strict=True):
            end = start + len(new)
            if len(new) > 1:
                tokens += len(new)
                token_contexts += len(new) * start + len(new) * (len(new) + 1) // 2
            else:
                sequences += 1
                contexts += end
        return ((self.prefill_s(tokens, token_contexts) if tokens else 0.0)
                + (self.decode_s(sequences, contexts) if sequences else 0.0))


@dataclass(frozen=True)
class SimProfile:
    """`shape`: the Hugging Face config keys of the model it stands for (layers, heads,
    hidden sizes, max_position_embeddings); `dtype`: its KV cache's; `mean_output_tokens`: an
    answer ends with a chance of 1 in this per token (0: only at max_tokens)."""

    name: str
    source: str
    shape: dict[str, int] = field(hash=False)
    latency: Latency
    dtype: str = "bfloat16"
    mean_output_tokens: int = 200
    fit_error: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        missing = {"num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "hidden_size", "intermediate_size"} - set(self.shape)
        if missing:
            raise ValueError(f"sim profile {self.name}: shape lacks {sorted(missing)}")
        if self.dtype not in ("bfloat16", "float16", "float32") or self.mean_output_tokens < 0:
            raise ValueError(f"sim profile {self.name}: dtype bfloat16|float16|float32 and "
                             f"mean_output_tokens >= 0")

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)


def profile_path(name: str) -> Path:
    """The file of profile `name`: a YAML path, or a name in configs/sim."""
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml"):
        return path
    return PROFILES_DIR / f"{name}.yaml"


def load_profile(name: str) -> SimProfile:
    """The profile `name` (configs/sim/NAME.yaml) or a profile file's."""
    path = profile_path(name)
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ValueError(f"no sim profile {name!r}: give one of {known} or a .yaml file")
    return parse_profile(path.read_text(), str(path))


def parse_profile(text: str, where: str) -> SimProfile:
    raw: Any = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a sim profile is a mapping")
    return from_mapping(SimProfile, raw, where)
