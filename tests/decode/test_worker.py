"""The decode worker's step, in process on a tiny model: continuous batching at step granularity."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from core.config import Config, load_config
from core.messages import DecodeRequest, GenerationTask, Sampling, TokenBatch, decode, encode
from decode.worker import DecodeWorker
from engine.runner import ModelRunner
from kvtransfer.wire import KVHeader, KVPayload

PROMPT_LEN = 8


@pytest.fixture
def worker(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[DecodeWorker, zmq.Socket]]:
    control = f"ipc://{tmp_path}/control.sock"
    config: Config = load_config(None, {"gateway.control_address": control,
                                        "decode.kv_bind": f"ipc://{tmp_path}/kv.sock"})
    gateway = zmq.Context.instance().socket(zmq.ROUTER)
    gateway.bind(control)
    runner = ModelRunner(tiny_model_dir, num_blocks=256, block_size=16)
    decode_worker = DecodeWorker("decode-0", config, runner, "fingerprint")
    yield decode_worker, gateway
    decode_worker.close()
    gateway.close(linger=0)


def arrive(worker: DecodeWorker, request_id: str, max_tokens: int) -> None:
    """A request lands with its (random but well-formed) KV, as the receiver would hand it over."""
    spec = worker.runner.spec
    task = GenerationTask(list(range(10, 10 + PROMPT_LEN)), Sampling(temperature=0.0), max_tokens,
                          [], True)
    shape = [spec.num_layers, PROMPT_LEN, spec.num_kv_heads, spec.head_dim]
    header = KVHeader(request_id, 0, 0, spec.num_layers, PROMPT_LEN, "float32", shape, 0,
                      encode(DecodeRequest(request_id, 0, task, 5)))
    worker._accept(KVPayload(header, torch.randn(shape), torch.randn(shape)))


def events_of_next_step(worker: DecodeWorker, gateway: zmq.Socket) -> dict[str, str | None]:
    assert worker.step()
    while True:
        _, data = gateway.recv_multipart()
        message = decode(data)
        if isinstance(message, TokenBatch):
            return {e.request_id: e.finish_reason for e in message.events}


def test_a_request_joins_the_running_batch_at_the_next_step(worker) -> None:
    decode_worker, gateway = worker
    for i in range(32):
        arrive(decode_worker, f"r{i}", max_tokens=100)
    assert len(events_of_next_step(decode_worker, gateway)) == 32
    arrive(decode_worker, "late", max_tokens=100)
    events = events_of_next_step(decode_worker, gateway)
    assert len(events) == 33 and "late" in events


def test_a_finished_sequence_leaves_the_batch_in_the_same_step(worker) -> None:
    decode_worker, gateway = worker
    free = decode_worker.runner.allocator.num_free
    arrive(decode_worker, "long", max_tokens=100)
    arrive(decode_worker, "short", max_tokens=2)  # the first token came from prefill
    assert events_of_next_step(decode_worker, gateway) == {"long": None, "short": "length"}
    assert [s.key[0] for s in decode_worker.scheduler.running] == ["long"]
    assert events_of_next_step(decode_worker, gateway) == {"long": None}
    held = len(decode_worker.scheduler.running[0].blocks)
    assert decode_worker.runner.allocator.num_free == free - held
