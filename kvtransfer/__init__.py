"""Moving KV between processes behind one interface: `make_sender` / `make_receiver`."""

from __future__ import annotations

import torch
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
                keys: CurveKeys | None = None, device: torch.device | None = None) -> KVSender:
    """The configured backend's sender (plain ZeroMQ when no config is given); with `keys`, a
    CURVE client of the receivers. "auto" is cuda_ipc for KV computed on a GPU (`device`),
    shm otherwise; chunks a backend cannot stage go inline through the host either way."""
    config = config or KVTransferConfig(backend="zmq")
    buffer_bytes = config.buffer_mb * 2**20
    backend = config.backend
    if backend == "auto":
        backend = "cuda_ipc" if device is not None and device.type == "cuda" else "shm"
    if backend == "shm":
        from kvtransfer.shm import ShmKVSender
        return ShmKVSender(context, buffer_bytes, config.lease_s, keys)
    if backend == "cuda_ipc":
        from kvtransfer.cuda_ipc import CudaIpcKVSender
        index = device.index if device is not None and device.type == "cuda" else None
        return CudaIpcKVSender(context, buffer_bytes, config.lease_s, index or 0, keys=keys)
    return KVSender(context, keys)


def make_receiver(context: zmq.Context, bind: str, keys: CurveKeys | None = None) -> KVReceiver:
    """A receiver bound at `bind`; with `keys`, a CURVE server that admits only the cluster's
    senders (give it a context of its own: see core.curve.CurveServer)."""
    return KVReceiver(context, bind, keys)
