"""The one interface the prefill and decode loops call, whatever the backend."""

from __future__ import annotations

from typing import Protocol

import torch

from kvtransfer.wire import KVPayload, KVRejected


class TransferError(RuntimeError):
    """A chunk could not be handed to the transport (peer gone, queue full)."""


class KVSender(Protocol):
    def send(
        self, address: str, request_id: str, epoch: int, meta: bytes,
        k: torch.Tensor, v: torch.Tensor, layer_start: int = 0,
    ) -> None:
        """Queue K and V ([layers, tokens, kv_heads, head_dim]) for the receiver at `address`."""

    def close(self) -> None: ...


class KVReceiver(Protocol):
    address: str  # the endpoint senders connect to
    rejected: int  # chunks dropped for a bad checksum or header

    def fileno_socket(self) -> object:
        """Something a zmq.Poller can wait on."""

    def drain(self) -> list[KVPayload]:
        """Every verified chunk waiting now, without blocking."""

    def take_rejections(self) -> list[KVRejected]:
        """Chunks dropped since the last call whose header named their request."""

    def close(self) -> None: ...
