"""Configuration: frozen dataclasses loaded from `configs/*.yaml`, with dotted overrides.

Every process loads the same file; the CLI turns its flags into overrides such as
`{"gateway.port": "8080"}` so that no setting is read from the environment deep in the code.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ModelConfig:
    name: str = "SmolLM2-135M-Instruct"
    cache_dir: str = "~/.cache/raging/models"
    dtype: str = "auto"  # bfloat16 where the CPU has bf16 instructions, else float32
    max_model_len: int = 0  # 0: the model's own max_position_embeddings
    # Products of at most this many rows (decode steps of few sequences) read the 4-/8-bit
    # blocks the model shipped in, where the weights are exactly those (engine.blocks).
    # -1: as many rows as that is faster, measured by each worker at load; 0: never.
    block_rows: int = -1

    def __post_init__(self) -> None:
        if self.block_rows < -1:
            raise ValueError(f"model.block_rows must be -1 (measured), 0 (never) or more, "
                             f"not {self.block_rows}")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    control_address: str = "tcp://127.0.0.1:8100"
    expect_prefill: int = 1
    expect_decode: int = 1
    max_inflight_requests: int = 512
    max_queued_tokens: int = 65536  # prompt tokens waiting for prefill; beyond it, 429
    heartbeat_timeout_s: float = 2.5  # a worker silent this long is dead (heartbeats: 0.5 s)
    stall_timeout_s: float = 10.0  # a worker with work but no layer computed this long: stalled
    progress_timeout_s: float = 300.0  # a request with no new token for this long fails
    keepalive_s: float = 10.0
    # An idle client connection stays open this long: longer than clients keep theirs (httpx
    # and the openai client: 5 s), so that no client sends on a connection being closed.
    http_keep_alive_s: int = 75
    max_body_bytes: int = 16 * 1024 * 1024
    # Conditional disaggregation: which prompts a decode worker prefills itself.
    local_prefill_max_tokens: int = 32  # prompts this short (0: none, unless no prefill pool)
    prefill_saturated_tokens: int = 1024  # every prefill worker holds this much: decode helps
    saturated_local_max_tokens: int = 256  # ... with prompts up to this long


@dataclass(frozen=True)
class WorkerConfig:
    num_kv_blocks: int = 4096
    block_size: int = 16
    # Step budgets in tokens at an empty context; deeper tokens cost more (engine/chunk_cost.py).
    max_batch_tokens: int = 2048
    chunk_tokens: int = 256  # prefill: chunks of prompts over max_batch_tokens; decode: the
    # step's budget for prompt tokens beside the running sequences' next ones
    # Prompts are prefilled earliest deadline first: arrival + this much per prompt token.
    ttft_ms_per_token: float = 5.0
    max_running: int = 64
    threads: int = 0  # torch intra-op threads; 0: leave torch's default
    cpus: str = ""  # pin the worker to these CPUs ("1", "0-1", "0,2"); empty: no pinning
    heartbeat_interval_s: float = 0.5
    kv_bind: str = "tcp://127.0.0.1:*"
    prefix_caching: bool = True  # prefill: keep full KV blocks for later prompts to reuse

    def __post_init__(self) -> None:
        if self.ttft_ms_per_token < 0:
            raise ValueError("ttft_ms_per_token must be >= 0")


KV_BACKENDS = ("zmq", "shm", "cuda_ipc")


@dataclass(frozen=True)
class KVTransferConfig:
    """How prefill workers send KV; decode workers accept every backend."""

    backend: str = "shm"  # zmq (tcp/ipc, any host) | shm (same host) | cuda_ipc (same GPU)
    buffer_mb: int = 64  # the shm / cuda_ipc staging buffer of each prefill worker
    lease_s: float = 30.0  # a staged chunk not released by then is reclaimed
    chunk_mb: float = 8.0  # layers of a request are sent together until a chunk holds this

    def __post_init__(self) -> None:
        if self.backend not in KV_BACKENDS:
            raise ValueError(f"kv_transfer.backend must be one of {KV_BACKENDS}, "
                             f"not {self.backend!r}")
        if self.buffer_mb <= 0 or self.lease_s <= 0 or self.chunk_mb <= 0:
            raise ValueError("kv_transfer.buffer_mb, lease_s and chunk_mb must be positive")


@dataclass(frozen=True)
class AuthConfig:
    """The gateway's API keys, each naming its tenant; none at all leaves the gateway open.

    Checked by the gateway (gateway/auth.py), which also reads `keys_file`; workers ignore it.
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # "KEY" or "KEY:TENANT"
    keys_file: str = ""  # one "KEY TENANT" per line: kept out of argv (ps) and of the YAML


@dataclass(frozen=True)
class InternalConfig:
    """Authentication of the internal ZeroMQ channels (control and KV) with CURVE: every
    process of a cluster reads the same keys folder (`python -m core.curve generate DIR`)."""

    curve: bool = False  # off: plain ZeroMQ, anyone who reaches a port may talk to it
    keys_dir: str = ""  # server.key_secret, client.key_secret, allowed_clients/*.key

    def __post_init__(self) -> None:
        if self.curve and not self.keys_dir:
            raise ValueError("internal.curve needs internal.keys_dir")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    internal: InternalConfig = field(default_factory=InternalConfig)


def load_config(path: str | Path | None = None, overrides: dict[str, str] | None = None) -> Config:
    """Read a YAML file (or defaults), apply `section.key` overrides, and validate types."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _parse_yaml(Path(path).read_text(), str(path)) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: top level must be a mapping")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ValueError(f"override {dotted!r} must look like section.key")
        # A str setting takes the text as is: "123", "yes" or "~" must not turn into 123/True/None.
        as_text = _hint_of(section, key) is str or not isinstance(value, str)
        parsed = value if as_text else _parse_yaml(value, f"override {dotted!r}")
        section_raw = raw.setdefault(section, {})
        if not isinstance(section_raw, dict):
            raise ValueError(f"config.{section}: expected a mapping")
        section_raw[key] = parsed
    return _build(Config, raw, "config")


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None


def _hint_of(section: str, key: str) -> Any:
    section_hint = typing.get_type_hints(Config).get(section)
    if not dataclasses.is_dataclass(section_hint):
        return None
    return typing.get_type_hints(section_hint).get(key)


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    values = {name: _convert(hints[name], raw[name], f"{where}.{name}") for name in raw}
    return cls(**values)


def _convert(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, where)
    if typing.get_origin(hint) is tuple:
        return _convert_tuple(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if any(_is_instance(value, t) for t in allowed):
        return value
    raise ValueError(f"{where}: expected {hint}, got {value!r}")


def _convert_tuple(hint: Any, value: Any, where: str) -> tuple[Any, ...]:
    """`tuple[X, ...]` of scalars from a YAML list. The items are not echoed in errors: they
    may be secrets (API keys)."""
    item_hint = typing.get_args(hint)[0]
    items = () if value is None else value
    if not isinstance(items, list | tuple) or not all(_is_instance(v, item_hint) for v in items):
        raise ValueError(f"{where}: expected a list of {item_hint.__name__}")
    return tuple(items)


def _is_instance(value: Any, hint: Any) -> bool:
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
