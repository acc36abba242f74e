"""What the gateway's routes share: config, tokenizer, membership, dispatcher, metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from core.config import Config
from core.tracing import Tracer
from gateway.dispatch import Dispatcher
from gateway.metrics import Metrics
from gateway.registry import Registry


@dataclass
class GatewayState:
    config: Config
    model_name: str
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase
    registry: Registry
    metrics: Metrics
    dispatcher: Dispatcher = field(init=False)
    started: int = field(default_factory=lambda: int(time.time()))
    control_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    tracer: Tracer | None = None  # None: tracing off

    def control_plane_up(self) -> bool:
        """False once a control-plane task has stopped: nothing would reach the workers."""
        return all(not task.done() for task in self.control_tasks)
