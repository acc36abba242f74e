"""Fixtures and helpers the gateway's tests share.

The helpers are plain functions: test modules import them from `tests.gateway.conftest`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from core.config import Role
from core.messages import Heartbeat, Register
from gateway.registry import Registry, WorkerInfo

FP = "smollm2|float32|30|3|64|16"  # the KV layout the registry's and the router's tests serve


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path) -> PreTrainedTokenizerBase:
    """The real model's tokenizer, a fresh one per module (a test may change its template)."""
    return AutoTokenizer.from_pretrained(real_model_dir)


def registry(timeout_s: float = 3.0, prefill: int = 1, decode: int = 1) -> Registry:
    return Registry(FP, timeout_s, prefill, decode)


def register(worker_id: str, role: Role = "prefill", instance: str = "i0", fingerprint: str = FP,
             num_blocks: int = 100, kv_address: str = "") -> Register:
    return Register(worker_id, instance, role, kv_address, fingerprint, 16, num_blocks,
                    prefix_caching=True)


def heartbeat(worker_id: str, instance: str = "i0", queued: int = 0, free: int = 100,
              running: int = 0) -> Heartbeat:
    return Heartbeat(worker_id, instance, queued, free, running, 0)


def picked(worker: WorkerInfo | None) -> str | None:
    return None if worker is None else worker.worker_id


def placed(worker_id: str, role: Role = "decode", cpus: tuple[int, ...] = (1,), threads: int = 1,
           max_running: int = 4, num_blocks: int = 100, host: str = "a",
           kv_bytes_per_token: int = 0) -> Register:
    """A worker registering where it computes: its host, CPUs and threads (packing's input)."""
    return Register(worker_id, "i0", role, "", FP, 16, num_blocks, host, cpus=list(cpus),
                    threads=threads, max_running=max_running if role == "decode" else 0,
                    prefix_caching=True, kv_bytes_per_token=kv_bytes_per_token)
