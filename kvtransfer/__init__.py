"""Moving KV between processes behind one interface: `make_sender` / `make_receiver`."""

from __future__ import annotations

import zmq

from core.config import KVTransferConfig
from core.curve import CurveKeys
from kvtransfer.base import TransferCounters, TransferError
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.wire import KVHeader, KVItem, KVNotice, KVPayload, KVRejected

__all__ = [
    "KVHeader", "KVItem", "KVNotice", "KVPayload", "KVReceiver", "KVRejected", "KVSender",
    "TransferCounters", "TransferError", "make_receiver", "make_sender",
]


def make_sender(context: zmq.Context, config: KVTransferConfig | None = None,
                keys: CurveKeys | None = None) -> KVSender:
    """The configured backend's sender (plain ZeroMQ when no config is given); with `keys`, a
    CURVE client of the receivers."""
    config = config or KVTransferConfig(backend="zmq")
    buffer_bytes = config.buffer_mb * 2**20
    if config.backend == "shm":
        from kvtransfer.shm import ShmKVSender
        return ShmKVSender(context, buffer_bytes, config.lease_s, keys)
    if config.backend == "cuda_ipc":
        from kvtransfer.cuda_ipc import CudaIpcKVSender
        return CudaIpcKVSender(context, buffer_bytes, config.lease_s, keys=keys)
    return KVSender(context, keys)


def make_receiver(context: zmq.Context, bind: str, keys: CurveKeys | None = None) -> KVReceiver:
    """A receiver bound at `bind`; with `keys`, a CURVE server that admits only the cluster's
    senders (give it a context of its own: see core.curve.CurveServer)."""
    return KVReceiver(context, bind, keys)
