"""The model folder a simulated model is served from: a Llama config of its profile's shape
with the simulated vocabulary, a byte-level tokenizer with a ChatML template, and the profile
itself, which workers read their step times from. No torch here: the gateway finds its
tokenizer here too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.sim.profile import SimProfile, load_profile, parse_profile
from engine.sim.tokens import BYTES, EOS, IM_START, SPECIAL_TOKENS, STATE_BYTES, VOCAB_SIZE
from engine.weights.spec import ModelSpec, kv_fingerprint, load_spec

PROFILE_FILE = "sim_profile.yaml"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sim_folder(profile_name: str, cache_dir: str | Path) -> Path:
    """The folder of profile `profile_name`, written (again, if the profile changed) under
    `cache_dir`."""
    profile = load_profile(profile_name)
    folder = Path(cache_dir).expanduser() / f"sim-{profile.name}"
    files = _files(profile)
    if any(not (folder / name).exists() or (folder / name).read_text() != text
           for name, text in files.items()):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            tmp = folder / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(folder / name)  # workers starting together see whole files only
    return folder


def folder_profile(folder: Path) -> SimProfile:
    """The profile a simulated model's folder was written for."""
    return parse_profile((folder / PROFILE_FILE).read_text(), str(folder / PROFILE_FILE))


def sim_fingerprint(folder: Path, kv_bytes: float) -> str:
    """The KV layout workers of this simulated model hold with `sim.kv_bytes` (the gateway
    admits workers by it)."""
    return kv_fingerprint(scaled_kv(load_spec(folder), kv_bytes), folder_profile(folder).dtype)


def scaled_kv(spec: ModelSpec, kv_bytes: float) -> ModelSpec:
    """`spec` with `kv_bytes` of its KV per token (one KV head, a narrower head), at least a
    state's worth."""
    if kv_bytes == 1.0:
        return spec
    width = max(STATE_BYTES, round(spec.num_kv_heads * spec.head_dim * kv_bytes))
    return dataclasses.replace(spec, num_heads=1, num_kv_heads=1, head_dim=width)


def _files(profile: SimProfile) -> dict[str, str]:
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "max_position_embeddings": 8192, **profile.shape, "vocab_size": VOCAB_SIZE,
              "bos_token_id": IM_START, "eos_token_id": EOS, "pad_token_id": EOS,
              "tie_word_embeddings": False, "torch_dtype": profile.dtype}
    generation = {"bos_token_id": IM_START, "eos_token_id": EOS}
    tokenizer_config = {"tokenizer_class": "TokenizersBackend", "bos_token": "<|im_start|>",
                        "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                        "unk_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
                        "model_max_length": config["max_position_embeddings"]}
    return {"config.json": _json(config), "generation_config.json": _json(generation),
            "tokenizer_config.json": _json(tokenizer_config),
            "tokenizer.json": _json(_byte_tokenizer()), PROFILE_FILE: profile.to_yaml()}


def _byte_tokenizer() -> dict[str, Any]:
    """A `tokenizers` byte-level BPE without merges: token id b is byte b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    by_byte = sorted(alphabet, key=lambda char: _byte_of(char))
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(by_byte)},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()))
    assert len(by_byte) == BYTES and tokenizer.get_vocab_size() == VOCAB_SIZE
    result: dict[str, Any] = json.loads(tokenizer.to_str())
    return result


def _byte_of(char: str) -> int:
    """The byte ByteLevel's alphabet shows as `char` (GPT-2's printable mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    unprintable = [b for b in range(BYTES) if b not in printable]
    return unprintable[ord(char) - BYTES]


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"
