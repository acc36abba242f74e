"""What the gateway's routes share: config, tokenizer, membership, routing, dispatcher, metrics."""

from __future__ import annotations

import asyncio
import datetime
import functools
import hashlib
import importlib.metadata
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from core.config import Config, GenerationDefaults
from core.tracing import Tracer
from gateway.autoscale import Autoscaler
from gateway.background import BackgroundResponses
from gateway.dispatch import Dispatcher
from gateway.infill import FillTokens, fill_tokens
from gateway.metrics import Metrics
from gateway.model_facts import ModelFacts
from gateway.registry import Registry
from gateway.response_store import ResponseStore
from gateway.routing import Router


@dataclass
class GatewayState:
    config: Config
    model_name: str
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase
    registry: Registry
    router: Router  # over `registry`
    metrics: Metrics
    dispatcher: Dispatcher = field(init=False)
    started: int = field(default_factory=lambda: int(time.time()))
    control_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    tracer: Tracer | None = None  # None: tracing off
    # What a request that leaves a field out gets (config, or the model's generation_config).
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    background: BackgroundResponses = field(default_factory=BackgroundResponses)
    facts: ModelFacts | None = None  # what the model is (the app's always has them)
    fill: FillTokens | None = field(init=False)  # fill-in-the-middle markers; None: it can't

    def __post_init__(self) -> None:
        # Here, before any request: later, the tokenizer is its own thread's alone.
        self.fill = fill_tokens(self.tokenizer)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request's `model` may give: gateway.served_model_name, else its own."""
        return self.config.gateway.served_model_name or (self.model_name,)

    @functools.cached_property
    def autoscaler(self) -> Autoscaler:
        """The pools' wanted sizes (`raging_pool_desired_workers`), from this gateway's view."""
        return Autoscaler(self.config.autoscale, self.registry, self.metrics.recent)

    @functools.cached_property
    def responses(self) -> ResponseStore:
        """The /v1/responses kept for `previous_response_id` and GET."""
        return ResponseStore(self.config.gateway.stored_responses)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: changes with the version and the model's KV layout
        (model, dtype), which is what changes the outputs of a seeded request."""
        seen = f"{server_version()} {self.registry.fingerprint}".encode()
        return "fp_" + hashlib.sha256(seen).hexdigest()[:10]

    def control_plane_up(self) -> bool:
        """False once a control-plane task has stopped: nothing would reach the workers."""
        return all(not task.done() for task in self.control_tasks)


def server_version() -> str:
    """The installed raging package's version; run from a source tree that was never installed
    (a GPU machine without network, say), the version its pyproject.toml names."""
    try:
        return importlib.metadata.version("raging")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def utc_text(unix_time: float | None = None) -> str:
    """A time (now, without one) as the APIs write one: RFC 3339 in UTC, `Z` for its zone."""
    moment = datetime.datetime.fromtimestamp(time.time() if unix_time is None else unix_time,
                                             datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")
