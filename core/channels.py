"""ZeroMQ control channels: the gateway's ROUTER and each worker's DEALER, typed by messages.

Workers connect to the gateway's one control address; the gateway replies by worker identity.
Malformed frames are dropped and counted here, never passed on. Given the cluster's CURVE keys,
the gateway admits only workers holding the client key, and they talk only to the gateway.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from core.curve import CurveKeys, CurveServer, make_client
from core.messages import MalformedMessage, Message, decode, encode

log = logging.getLogger(__name__)
_HWM = 100_000


class ControlServer:
    """Gateway side: one ROUTER socket bound at the control address (asyncio). With `keys`,
    run `watch_rejections` as a task to keep `rejected_peers` current."""

    def __init__(self, context: zmq.asyncio.Context, address: str,
                 keys: CurveKeys | None = None) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.curve = CurveServer(self.socket, keys) if keys is not None else None
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its id
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, _HWM)
        self.socket.setsockopt(zmq.RCVHWM, _HWM)
        self.socket.bind(address)
        self.dropped = 0

    @property
    def rejected_peers(self) -> int:
        """Peers turned away for failing CURVE authentication, since the start."""
        return self.curve.rejected.count if self.curve is not None else 0

    async def watch_rejections(self) -> None:
        """Count turned-away peers as they come, until cancelled (returns at once without
        CURVE)."""
        if self.curve is not None:
            await self.curve.rejected.watch()

    async def recv(self) -> tuple[str, Message]:
        """The next well-formed message and the worker id that sent it."""
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) == 2:
                try:
                    return frames[0].decode(), decode(frames[1])
                except (MalformedMessage, UnicodeDecodeError) as exc:
                    log.warning("dropped malformed control message: %s", exc)
            self.dropped += 1

    def pending(self) -> bool:
        """Whether messages wait to be read."""
        events = self.socket.get(zmq.EVENTS)
        assert isinstance(events, int)
        return bool(events & zmq.POLLIN)

    def send(self, worker_id: str, message: Message) -> None:
        """Fire and forget: a message to a worker that is gone is dropped by ZeroMQ."""
        self.socket.send_multipart([worker_id.encode(), encode(message)], flags=zmq.NOBLOCK)

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.curve is not None:
            self.curve.close()


class ControlClient:
    """Worker side: a DEALER connected to the gateway, identified by the worker id (blocking)."""

    def __init__(self, context: zmq.Context, address: str, worker_id: str,
                 keys: CurveKeys | None = None) -> None:
        self.socket = context.socket(zmq.DEALER)
        if keys is not None:
            make_client(self.socket, keys)
        self.socket.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, _HWM)
        self.socket.setsockopt(zmq.RCVHWM, _HWM)
        self.socket.connect(address)
        self.dropped = 0

    def send(self, message: Message) -> None:
        self.socket.send(encode(message))

    def take_waiting(self) -> list[Message]:
        """Every message waiting now, without blocking."""
        messages: list[Message] = []
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                if len(frames) != 1:
                    raise MalformedMessage(f"expected 1 frame, got {len(frames)}")
                messages.append(decode(frames[0]))
            except MalformedMessage as exc:
                log.warning("dropped malformed control message: %s", exc)
                self.dropped += 1

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` gives queued messages (a last Leave) that long to go out."""
        self.socket.close(linger=linger_ms)
