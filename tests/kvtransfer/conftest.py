"""Fixtures and helpers shared by the KV transfer tests.

The helpers are plain functions: test modules import them from `tests.kvtransfer.conftest`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvtransfer import KVReceiver, KVSender, make_receiver, make_sender
from kvtransfer.wire import KVHeader, KVItem, KVPayload, Placement, as_bytes, checksum, dtype_name

WAIT_S = 5.0  # the longest any one wait in these tests may take
SHAPE = (2, 5, 3, 8)  # [layers, tokens, kv_heads, head_dim]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["tcp", "ipc"])
def bind(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a receiver binds: loopback tcp, or an ipc socket in this test's folder."""
    if request.param == "tcp":
        return "tcp://127.0.0.1:*"
    path = tmp_path / "kv.sock"
    assert len(str(path)) < 100, "ipc paths are limited to ~107 bytes"
    return f"ipc://{path}"


@pytest.fixture
def receiver(context: zmq.Context, bind: str) -> Iterator[KVReceiver]:
    receiver = make_receiver(context, bind)
    yield receiver
    receiver.close()


@pytest.fixture
def sender(context: zmq.Context) -> Iterator[KVSender]:
    sender = make_sender(context)
    yield sender
    sender.close()


@pytest.fixture
def dealer(context: zmq.Context, receiver: KVReceiver) -> Iterator[zmq.Socket]:
    """A raw peer of the receiver, as a sender's socket is: frames sent on it arrive in order."""
    socket = context.socket(zmq.DEALER)
    socket.connect(receiver.address)
    yield socket
    socket.close(linger=0)


# --- data ------------------------------------------------------------------------------------


def kv(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE,
       ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk, the same for the same seed in every process."""
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k, v


def header_for(k: torch.Tensor, v: torch.Tensor, placement: Placement | None = None,
               **changes: Any) -> KVHeader:
    """The header a sender would write for K and V (inline, unless placed), with `changes`."""
    header = KVHeader(
        request_id="r", epoch=0, layer_start=0, layer_end=k.shape[0], num_tokens=k.shape[1],
        dtype=dtype_name(k.dtype), shape=list(k.shape),
        checksum=checksum(as_bytes(k), as_bytes(v)), placement=placement,
    )
    return dataclasses.replace(header, **changes)


# --- receiving -------------------------------------------------------------------------------


def keep(item: KVItem) -> KVItem:
    """What a worker's handler does with a payload it keeps: copy it out of the sender's
    buffer (a borrowed view is valid only during the drain). `borrowed` is left as it came."""
    if isinstance(item, KVPayload):
        return dataclasses.replace(item, k=item.k.clone(), v=item.v.clone())
    return item


def receive(receiver: KVReceiver, count: int, until: Callable[[KVItem], bool] | None = None,
            ) -> list[KVItem]:
    """Poll and drain until `count` items arrived (or, given `until`, until one such item
    did), copying each as a worker would; fails after WAIT_S."""
    got: list[KVItem] = []
    deadline = time.monotonic() + WAIT_S

    def done() -> bool:
        return any(map(until, got)) if until is not None else len(got) >= count

    while not done():
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        assert remaining_ms > 0, f"only {len(got)} items arrived: {got}"
        receiver.fileno_socket().poll(min(remaining_ms, 100))
        receiver.drain(lambda item: got.append(keep(item)))
    return got


def receive_nothing_more(receiver: KVReceiver) -> list[KVItem]:
    """What else arrives within a moment (nothing, in a passing test)."""
    time.sleep(0.1)
    got: list[KVItem] = []
    receiver.drain(lambda item: got.append(keep(item)))
    return got


def payloads(items: list[KVItem]) -> list[KVPayload]:
    assert all(isinstance(item, KVPayload) for item in items), items
    return [item for item in items if isinstance(item, KVPayload)]


def is_payload_of(request_id: str) -> Callable[[KVItem], bool]:
    return lambda item: isinstance(item, KVPayload) and item.header.request_id == request_id
