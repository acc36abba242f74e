"""What the gateway's routes share: config, tokenizer, membership, dispatcher, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from core.config import Config
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
