"""Moving KV between processes behind one interface: `make_sender` / `make_receiver`."""

from __future__ import annotations

import zmq

from kvtransfer.base import KVReceiver, KVSender, TransferError
from kvtransfer.wire import KVHeader, KVPayload
from kvtransfer.zmq_backend import ZmqKVReceiver, ZmqKVSender

__all__ = [
    "KVHeader", "KVPayload", "KVReceiver", "KVSender", "TransferError", "make_receiver",
    "make_sender",
]


def make_sender(context: zmq.Context) -> KVSender:
    return ZmqKVSender(context)


def make_receiver(context: zmq.Context, bind: str) -> KVReceiver:
    return ZmqKVReceiver(context, bind)
