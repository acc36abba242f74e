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
    as_bytes,
    checksum,
    dtype_name,
)

log = logging.getLogger(__name__)
_MAX_PEERS = 64
_SNDHWM = 1000


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
        try:
            self._socket(address).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise TransferError(f"KV receiver {address} is not draining") from None
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
        if len(frames) != 3:
            return None
        try:
            header = HEADER_CODEC.decode(frames[0].bytes)
        except MalformedMessage as exc:
            log.warning("dropped KV chunk with a bad header: %s", exc)
            return None
        k_bytes, v_bytes = frames[1].buffer, frames[2].buffer
        if header.dtype not in DTYPES or checksum(k_bytes, v_bytes) != header.checksum:
            log.warning("dropped KV chunk for %s: dtype or checksum mismatch", header.request_id)
            return None
        dtype = DTYPES[header.dtype]
        try:
            k = torch.frombuffer(k_bytes, dtype=dtype).view(header.shape)
            v = torch.frombuffer(v_bytes, dtype=dtype).view(header.shape)
        except (RuntimeError, ValueError):
            log.warning("dropped KV chunk for %s: shape does not fit", header.request_id)
            return None
        return KVPayload(header, k, v)

    def close(self) -> None:
        self.socket.close(linger=0)
