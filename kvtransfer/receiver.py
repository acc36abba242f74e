"""Receiving KV: one ROUTER socket that reads chunks wherever they lie, and verifies each."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import torch
import zmq

from core.codec import MalformedMessage
from core.curve import CurveKeys, CurveServer
from core.logs import about
from kvtransfer.base import BadChunk, TransferCounters
from kvtransfer.cuda_ipc import CudaIpcReader
from kvtransfer.shm import ShmReader
from kvtransfer.wire import (
    DTYPES,
    FORWARD_CODEC,
    RELEASE_CODEC,
    KVHeader,
    KVItem,
    KVNotice,
    KVPayload,
    KVRejected,
    KVRelease,
    checksum,
    header_problem,
)

log = logging.getLogger(__name__)


class PlacementReader(Protocol):
    def read(self, header: KVHeader) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a placed chunk, verified; BadChunk if it is not as described. They may
        view the sender's buffer, so they are valid only until the region is released."""

    def close(self) -> None: ...


class KVReceiver:
    """The interface the decode loop calls: bound at `bind` (tcp://127.0.0.1:* or ipc://path),
    it accepts every backend's chunks, so senders may differ in backend. With `keys`, only
    senders holding the cluster's client key get through (see core/curve.py)."""

    def __init__(self, context: zmq.Context, bind: str, keys: CurveKeys | None = None) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.curve = CurveServer(self.socket, keys) if keys is not None else None
        self.socket.bind(bind)
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("receiving KV at %s%s", self.address, " (CURVE)" if self.curve else "")
        self.readers: dict[str, PlacementReader] = {"shm": ShmReader(),
                                                     "cuda_ipc": CudaIpcReader()}
        self.counters = TransferCounters()
        self.dropped: Counter[str] = Counter()  # chunks dropped, by kind of fault
        self.releases: list[list[bytes]] = []  # placed chunks read in this drain

    @property
    def rejected(self) -> int:
        return sum(self.dropped.values())

    @property
    def rejected_peers(self) -> int:
        """Peers turned away for failing CURVE authentication, since the start."""
        return self.curve.rejected.take_waiting() if self.curve is not None else 0

    def drain(self, handle: Callable[[KVItem], None]) -> int:
        """Hand every chunk and notice waiting now to `handle`, in arrival order, without
        blocking; the number handed. A chunk that fails verification but names its request
        comes as a KVRejected.

        A payload's K and V may view a sender's staging buffer (`borrowed`): `handle` must copy
        what it keeps, because the regions go back to their senders when this returns.
        """
        count = 0
        try:
            while True:
                try:
                    frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return count
                item = self._read(frames)
                if item is not None:
                    handle(item)
                    count += 1
        finally:
            for release in self.releases:
                self.socket.send_multipart(release)
            self.releases = []

    def _read(self, frames: list[zmq.Frame]) -> KVItem | None:
        identity, first, data = frames[0], frames[1], frames[2:]  # ROUTER: never fewer than 2
        try:
            message = FORWARD_CODEC.decode(first.bytes)
        except MalformedMessage as exc:
            log.warning("dropped a KV message with a bad header: %s", exc)
            self.dropped["malformed"] += 1
            return None
        if isinstance(message, KVNotice):
            if data:
                self._drop_unnamed("frames", "a notice with data frames")
                return None
            return message
        started = time.perf_counter()
        try:
            k, v = self._chunk(identity, message, data)
        except BadChunk as exc:
            return self._reject(message, exc)
        self.counters.add(k.nbytes + v.nbytes, time.perf_counter() - started)
        return KVPayload(message, k, v, borrowed=message.placement is not None)

    def _chunk(self, identity: zmq.Frame, header: KVHeader, data: list[zmq.Frame],
               ) -> tuple[torch.Tensor, torch.Tensor]:
        problem = header_problem(header)
        if problem is not None:
            raise BadChunk("header", problem)
        if header.placement is None:
            return _inline(header, data)
        if data:
            raise BadChunk("frames", f"{len(data)} data frames with a placed chunk")
        reader = self.readers.get(header.placement.kind)
        if reader is None:
            raise BadChunk("placement", f"no reader for {header.placement.kind!r} here")
        release = KVRelease(header.placement.segment, header.placement.ticket)
        self.releases.append([identity.bytes, RELEASE_CODEC.encode(release)])
        return reader.read(header)

    def _reject(self, header: KVHeader, exc: BadChunk) -> KVRejected:
        log.warning("dropped KV chunk for %s: %s", header.request_id, exc,
                    extra=about(header.key))
        self.dropped[exc.kind] += 1
        return KVRejected(header.request_id, header.epoch, str(exc))

    def _drop_unnamed(self, kind: str, reason: str) -> None:
        log.warning("dropped a KV message: %s", reason)
        self.dropped[kind] += 1

    def fileno_socket(self) -> zmq.Socket:
        """What a zmq.Poller waits on."""
        return self.socket

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.socket.close(linger=0)
        if self.curve is not None:
            self.curve.close()


def _inline(header: KVHeader, data: list[zmq.Frame]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(data) != 2:
        raise BadChunk("frames", f"{len(data)} data frames, not 2")
    k_bytes, v_bytes = data[0].buffer, data[1].buffer
    if checksum(k_bytes, v_bytes) != header.checksum:
        raise BadChunk("checksum", "checksum mismatch")
    dtype = DTYPES[header.dtype]
    try:
        return (torch.frombuffer(k_bytes, dtype=dtype).view(header.shape),
                torch.frombuffer(v_bytes, dtype=dtype).view(header.shape))
    except (RuntimeError, ValueError):
        raise BadChunk("header", "shape does not fit the buffers") from None
