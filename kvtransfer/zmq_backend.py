"""KV over ZeroMQ PUSH/PULL (tcp or ipc), buffers sent zero-copy as multipart frames."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import zmq

from core.codec import MalformedMessage
from kvtransfer.base import TransferError
from kvtransfer.wire import (
    DTYPES,
    HEADER_CODEC,
    KVHeader,
    KVPayload,
    KVRejected,
    as_bytes,
    checksum,
    dtype_name,
)

log = logging.getLogger(__name__)
_MAX_PEERS = 64
_SNDHWM = 16  # whole prompts' KV each: bound what waits for a slow receiver
_CONNECT_WAIT_MS = 2000


class ZmqKVSender:
    """Keeps one PUSH socket per receiver address (bounded, least recently used closed first)."""

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self.sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.bytes_sent = 0

    def send(
        self, address: str, request_id: str, epoch: int, meta: bytes,
        k: torch.Tensor, v: torch.Tensor, layer_start: int = 0,
    ) -> None:
        k_bytes, v_bytes = as_bytes(k), as_bytes(v)
        header = KVHeader(
            request_id=request_id, epoch=epoch, layer_start=layer_start,
            layer_end=layer_start + k.shape[0], num_tokens=k.shape[1], dtype=dtype_name(k.dtype),
            shape=list(k.shape), checksum=checksum(k_bytes, v_bytes), meta=meta,
        )
        frames = [HEADER_CODEC.encode(header), k_bytes, v_bytes]
        socket = self._socket(address)
        # With IMMEDIATE, nothing queues for a peer that is not connected (a new socket's
        # handshake, or a dead receiver): wait a moment for it, then give up.
        if not socket.poll(_CONNECT_WAIT_MS, zmq.POLLOUT):
            raise TransferError(f"KV receiver {address} is not reachable or not draining")
        socket.send_multipart(frames, copy=False)
        self.bytes_sent += k_bytes.nbytes + v_bytes.nbytes

    def _socket(self, address: str) -> zmq.Socket:
        if address in self.sockets:
            self.sockets.move_to_end(address)
            return self.sockets[address]
        if len(self.sockets) >= _MAX_PEERS:
            _, oldest = self.sockets.popitem(last=False)
            oldest.close(linger=0)
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, _SNDHWM)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(address)
        self.sockets[address] = socket
        return socket

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close()
        self.sockets.clear()


class ZmqKVReceiver:
    """A PULL socket bound at `bind` (e.g. tcp://127.0.0.1:* or ipc:///path)."""

    def __init__(self, context: zmq.Context, bind: str) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(bind)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.rejected = 0
        self.rejections: list[KVRejected] = []

    def fileno_socket(self) -> zmq.Socket:
        return self.socket

    def drain(self) -> list[KVPayload]:
        payloads: list[KVPayload] = []
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return payloads
            payload = self._verify(frames)
            if payload is None:
                self.rejected += 1
            else:
                payloads.append(payload)

    def _verify(self, frames: list[zmq.Frame]) -> KVPayload | None:
        try:
            header = HEADER_CODEC.decode(frames[0].bytes)
        except MalformedMessage as exc:
            log.warning("dropped KV chunk with a bad header: %s", exc)
            return None
        if len(frames) != 3:
            return self._reject(header, f"{len(frames)} frames, not 3")
        k_bytes, v_bytes = frames[1].buffer, frames[2].buffer
        if header.dtype not in DTYPES or checksum(k_bytes, v_bytes) != header.checksum:
            return self._reject(header, "dtype or checksum mismatch")
        dtype = DTYPES[header.dtype]
        if any(d < 0 for d in header.shape) or header.shape[:2] != [
                header.layer_end - header.layer_start, header.num_tokens]:
            return self._reject(header, "shape does not match the header")
        try:
            k = torch.frombuffer(k_bytes, dtype=dtype).view(header.shape)
            v = torch.frombuffer(v_bytes, dtype=dtype).view(header.shape)
        except (RuntimeError, ValueError):
            return self._reject(header, "shape does not fit the buffers")
        return KVPayload(header, k, v)

    def _reject(self, header: KVHeader, reason: str) -> None:
        log.warning("dropped KV chunk for %s: %s", header.request_id, reason)
        self.rejections.append(KVRejected(header.request_id, header.epoch, reason))

    def take_rejections(self) -> list[KVRejected]:
        rejections, self.rejections = self.rejections, []
        return rejections

    def close(self) -> None:
        self.socket.close(linger=0)
