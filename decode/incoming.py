"""KV arriving for requests not yet admitted, collected layer by layer. Pure bookkeeping.

A request is expected from its `DecodeRequest` notice on; its chunks must then come in layer
order with the request's shape. A chunk for a request not expected here (never announced,
aborted, finished, or an older epoch) is dropped and counted; it never touches the KV cache.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from core.messages import DecodeRequest
from kvtransfer import KVPayload

Key = tuple[str, int]  # (request id, epoch)


@dataclass
class IncomingKV:
    request: DecodeRequest
    deadline: float  # the lease: past it, the KV is dropped and the request failed
    layers: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    next_layer: int = 0


class IncomingTable:
    def __init__(self, num_layers: int, kv_dims: tuple[int, int], dtype: str, fingerprint: str,
                 lease_s: float) -> None:
        self.num_layers = num_layers
        self.kv_dims = kv_dims  # (kv_heads, head_dim)
        self.dtype = dtype
        self.fingerprint = fingerprint
        self.lease_s = lease_s
        self.pending: dict[Key, IncomingKV] = {}
        self.dropped: Counter[str] = Counter()  # chunks, by reason
        self.expired = 0  # entries dropped because their lease ran out

    def expect(self, request: DecodeRequest, now: float) -> str | None:
        """Start collecting the request's KV; why it cannot be taken, or None."""
        if request.fingerprint != self.fingerprint:
            return (f"KV layout mismatch: the prefill worker computed {request.fingerprint}, "
                    f"this decode worker holds {self.fingerprint}")
        epochs = [k[1] for k in self.pending if k[0] == request.request_id]
        if any(epoch > request.epoch for epoch in epochs):
            self.dropped["stale epoch"] += 1  # the request has moved on to a newer epoch
            return None
        for epoch in epochs:
            del self.pending[(request.request_id, epoch)]
        self.pending[(request.request_id, request.epoch)] = IncomingKV(request, now + self.lease_s)
        return None

    def add(self, payload: KVPayload) -> str | None:
        """File a verified chunk; why its request must fail, or None."""
        header = payload.header
        key = (header.request_id, header.epoch)
        entry = self.pending.get(key)
        if entry is None:
            stale = any(k[0] == header.request_id and k[1] > header.epoch for k in self.pending)
            self.dropped["stale epoch" if stale else "unknown request"] += 1
            return None
        tokens = len(entry.request.task.prompt_ids)
        layers = header.layer_end - header.layer_start
        if (header.layer_start != entry.next_layer or header.layer_end > self.num_layers
                or header.shape != [layers, tokens, *self.kv_dims] or header.dtype != self.dtype):
            del self.pending[key]
            self.dropped["wrong shape"] += 1
            return "the KV did not match its request"
        k, v = payload.k, payload.v
        if payload.borrowed:  # it views the sender's buffer, which is released at the next drain
            k, v = k.clone(), v.clone()
        entry.layers.append((header.layer_start, k, v))
        entry.next_layer = header.layer_end
        return None

    def take(self, key: Key) -> IncomingKV | None:
        """Stop collecting the request's KV and return what arrived (None if not expected)."""
        return self.pending.pop(key, None)

    def is_complete(self, entry: IncomingKV) -> bool:
        return entry.next_layer == self.num_layers

    def expire(self, now: float) -> list[Key]:
        """Drop the entries whose lease ran out; their keys."""
        expired = [key for key, entry in self.pending.items() if entry.deadline <= now]
        for key in expired:
            del self.pending[key]
        self.expired += len(expired)
        return expired
