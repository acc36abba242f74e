"""Sending KV chunks and notices over ZeroMQ, one DEALER socket per receiver address."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import zmq

from core.codec import MalformedMessage
from core.config import KVBackend
from core.curve import CurveKeys, make_client
from kvtransfer.base import TransferCounters, TransferError
from kvtransfer.ring import RingAllocator
from kvtransfer.wire import (
    FORWARD_CODEC,
    RELEASE_CODEC,
    KVHeader,
    KVNotice,
    Placement,
    as_bytes,
    checksum,
    dtype_name,
)

log = logging.getLogger(__name__)

_MAX_PEERS = 64
_SNDHWM = 64  # messages (a layer's chunk each) that may wait for a slow receiver
_CONNECT_WAIT_MS = 2000
_UNREACHABLE_S = 10.0  # a receiver found unreachable gets no new connect wait for this long
_WAIT_SLICE_MS = 100  # how often a connect wait calls `while_waiting`
_FULL_WAIT_S = 0.05  # how long a send waits for room in a full staging buffer


def layers_per_chunk(bytes_per_layer: int, chunk_bytes: int) -> int:
    """How many layers to send in one chunk: each chunk costs a fixed ~0.1-0.2 ms of Python on
    both sides, so short prompts send several layers at once, long ones one each."""
    return max(1, chunk_bytes // max(1, bytes_per_layer))


class KVSender:
    """The interface the prefill loop calls, whatever the backend.

    Chunks and notices to one address arrive in the order they were sent. This class sends K
    and V as frames after the header, zero-copy; a backend that stages them elsewhere (shared
    memory, a CUDA buffer) overrides `_place`. With `keys`, it sends only to receivers
    holding the cluster's server key, as an authenticated client (see core/curve.py).
    """

    backend: KVBackend = "zmq"

    def __init__(self, context: zmq.Context, keys: CurveKeys | None = None) -> None:
        self.context = context
        self.keys = keys
        self.sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.unreachable: dict[str, float] = {}  # address: when a send gave up on it
        self.counters = TransferCounters()  # chunks sent by this backend's own means
        self.inline = TransferCounters()  # a staging backend's chunks sent inline instead
        self.while_waiting: Callable[[], None] = lambda: None  # the worker's heartbeat

    def send_layers(self, address: str, request_id: str, epoch: int, layer_start: int,
                    k: torch.Tensor, v: torch.Tensor, token_start: int = 0,
                    stage: bool = True) -> None:
        """Send K and V of layers layer_start.. ([layers, tokens, kv_heads, head_dim]) of the
        tokens from position `token_start` of the request's prompt; `stage` False: inline in
        the message, whatever the backend (a receiver on another host)."""
        started = time.perf_counter()
        socket = self._writable(address)
        placed = self._place(k, v) if stage else None
        if placed is None:
            k, v = self._inline(k, v)
            k_bytes, v_bytes = as_bytes(k), as_bytes(v)
            placement, digest, data = None, checksum(k_bytes, v_bytes), [k_bytes, v_bytes]
        else:
            (placement, digest), data = placed, []
        header = KVHeader(
            request_id=request_id, epoch=epoch, layer_start=layer_start,
            layer_end=layer_start + k.shape[0], num_tokens=k.shape[1], dtype=dtype_name(k.dtype),
            shape=list(k.shape), checksum=digest, placement=placement, token_start=token_start,
        )
        try:
            self._send(address, socket, [FORWARD_CODEC.encode(header), *data])
        except TransferError:
            if placement is not None:
                self._unplace(placement)
            raise
        staged_here = placement is not None or self.backend == "zmq"
        counters = self.counters if staged_here else self.inline
        counters.add(k.nbytes + v.nbytes, time.perf_counter() - started)

    def _send(self, address: str, socket: zmq.Socket, frames: list[Any]) -> None:
        """Send `frames` without waiting: the socket polled writable, but a dying receiver's
        pipe can go in between, and a blocking send would then wait for good."""
        try:
            socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters.failures += 1
            self.unreachable[address] = time.monotonic()
            raise TransferError(f"KV receiver {address} went away during a send") from None

    def _unplace(self, placement: Placement) -> None:
        """Free the staged region of a chunk that was not sent (only staging senders have
        one)."""

    def totals(self) -> list[tuple[KVBackend, TransferCounters]]:
        """The counters by the backend that moved the chunks: a staging backend's inline
        chunks (a receiver on another host, a full buffer) count as zmq."""
        if self.backend == "zmq" or not self.inline.chunks:
            return [(self.backend, self.counters)]
        return [(self.backend, self.counters), ("zmq", self.inline)]

    @property
    def staged(self) -> int:
        """Chunks staged outside their messages and not yet released by their receivers."""
        return 0

    @property
    def leases_expired(self) -> int:
        """Staged chunks reclaimed because their receiver never released them."""
        return 0

    def notify(self, address: str, request_id: str, epoch: int, meta: bytes) -> None:
        """Send a control message for the receiving worker, ordered with the chunks."""
        notice = FORWARD_CODEC.encode(KVNotice(request_id, epoch, meta))
        self._send(address, self._writable(address), [notice])

    def _place(self, k: torch.Tensor, v: torch.Tensor) -> tuple[Placement, int] | None:
        """Stage K and V outside the message: (where, checksum), or None to send them inline."""
        return None

    def _inline(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as contiguous host tensors that can go in a message (copied off a GPU)."""
        return k.contiguous().cpu(), v.contiguous().cpu()

    def _writable(self, address: str) -> zmq.Socket:
        socket = self._socket(address)
        # With IMMEDIATE, nothing queues for a peer that is not connected (a new socket's
        # handshake, or a dead receiver): wait a moment for it, then give up. That wait stalls
        # the prefill loop, so a receiver given up on moments ago gets none.
        given_up_at = self.unreachable.get(address)
        recent = given_up_at is not None and time.monotonic() - given_up_at < _UNREACHABLE_S
        if not self._wait_writable(socket, 0 if recent else _CONNECT_WAIT_MS):
            self.counters.failures += 1
            if not recent:
                self.unreachable[address] = time.monotonic()
            raise TransferError(f"KV receiver {address} is not reachable or not draining")
        self.unreachable.pop(address, None)
        return socket

    def _wait_writable(self, socket: zmq.Socket, wait_ms: int) -> bool:
        """Whether the socket takes a message within `wait_ms`; `while_waiting` runs every
        slice of the wait, so the worker stays alive to the gateway meanwhile."""
        deadline = time.monotonic() + wait_ms / 1000
        while not socket.poll(min(wait_ms, _WAIT_SLICE_MS), zmq.POLLOUT):
            if time.monotonic() >= deadline:
                return False
            self.while_waiting()
        return True

    def _socket(self, address: str) -> zmq.Socket:
        if address in self.sockets:
            self.sockets.move_to_end(address)
            return self.sockets[address]
        if len(self.sockets) >= _MAX_PEERS:
            oldest_address, oldest = self.sockets.popitem(last=False)
            oldest.close(linger=0)
            self.unreachable.pop(oldest_address, None)
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, _SNDHWM)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 1000)
        if self.keys is not None:
            make_client(socket, self.keys)
        socket.connect(address)
        self.sockets[address] = socket
        return socket

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close()
        self.sockets.clear()


class StagedKVSender(KVSender, ABC):
    """A sender that stages chunks in a buffer of its own (`_stage`), reusing each region once
    its receiver releases it. A chunk that finds no room within a moment goes inline."""

    handle = b""  # what a receiver needs to open the buffer, if its name is not enough

    def __init__(self, context: zmq.Context, segment: str, capacity: int, lease_s: float,
                 keys: CurveKeys | None = None) -> None:
        super().__init__(context, keys)
        self.segment = segment
        self.ring = RingAllocator(capacity, lease_s)
        self.inline_fallbacks = 0

    @property
    def staged(self) -> int:
        # Leases also run out while nothing new is staged: a dead receiver's chunks are counted
        # out here, not only at the next allocation.
        self._take_releases()
        self.ring.reclaim(time.monotonic())
        return self.ring.in_use

    @property
    def leases_expired(self) -> int:
        return self.ring.expired

    def _stageable(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        return True

    @abstractmethod
    def _stage(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Copy K then V to `offset` of the buffer; their checksum."""

    def _place(self, k: torch.Tensor, v: torch.Tensor) -> tuple[Placement, int] | None:
        if not self._stageable(k, v):
            return None
        allocated = self._allocate(k.nbytes + v.nbytes)
        if allocated is None:
            self.inline_fallbacks += 1
            return None
        offset, ticket = allocated
        digest = self._stage(offset, k, v)
        return Placement(self.backend, self.segment, offset, ticket, self.handle), digest

    def _unplace(self, placement: Placement) -> None:
        self.ring.release(placement.ticket)

    def _allocate(self, size: int) -> tuple[int, int] | None:
        """A region of `size` bytes, waiting a moment for receivers to release one if full."""
        deadline = time.monotonic() + _FULL_WAIT_S
        while True:
            self._take_releases()
            allocated = self.ring.allocate(size, time.monotonic())
            if allocated is not None or size > self.ring.capacity:
                return allocated
            if time.monotonic() >= deadline or not self._wait_for_release(deadline):
                return None

    def _wait_for_release(self, deadline: float) -> bool:
        poller = zmq.Poller()
        for socket in self.sockets.values():
            poller.register(socket, zmq.POLLIN)
        return bool(poller.poll(max(1, int((deadline - time.monotonic()) * 1000))))

    def _take_releases(self) -> None:
        """Free the regions that receivers say they are done with."""
        for socket in self.sockets.values():
            while socket.poll(0, zmq.POLLIN):
                try:
                    release = RELEASE_CODEC.decode(socket.recv())
                except MalformedMessage as exc:  # its region waits for its lease instead
                    log.warning("dropped a malformed KV release: %s", exc)
                    continue
                if release.segment == self.segment:
                    self.ring.release(release.ticket)
