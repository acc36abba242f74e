"""Moving KV between processes behind one interface: `make_sender` / `make_receiver`."""

from __future__ import annotations

import zmq

from core.config import KVTransferConfig
from kvtransfer.base import TransferCounters, TransferError
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.wire import KVHeader, KVItem, KVNotice, KVPayload, KVRejected

__all__ = [
    "KVHeader", "KVItem", "KVNotice", "KVPayload", "KVReceiver", "KVRejected", "KVSender",
    "TransferCounters", "TransferError", "make_receiver", "make_sender",
]


def make_sender(context: zmq.Context, config: KVTransferConfig | None = None) -> KVSender:
    """The configured backend's sender (plain ZeroMQ when no config is given)."""
    config = config or KVTransferConfig(backend="zmq")
    buffer_bytes = config.buffer_mb * 2**20
    if config.backend == "shm":
        from kvtransfer.shm import ShmKVSender
        return ShmKVSender(context, buffer_bytes, config.lease_s)
    if config.backend == "cuda_ipc":
        from kvtransfer.cuda_ipc import CudaIpcKVSender
        return CudaIpcKVSender(context, buffer_bytes, config.lease_s)
    return KVSender(context)


def make_receiver(context: zmq.Context, bind: str) -> KVReceiver:
    return KVReceiver(context, bind)
