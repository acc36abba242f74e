"""KV arriving for requests not yet admitted, collected layer by layer. Pure bookkeeping.

A request is expected from its `DecodeRequest` notice on; its chunks must then come in order:
the prompt's tokens in consecutive ranges (one range when the prompt was prefilled in one
pass, one per prefill chunk otherwise), each range's layers in order before the next range
starts. The request's KV is complete once every layer of every prompt token is in; for a
pulled prefix (decode/pulls.py), every layer of the prefix's tokens. A chunk for
a request not expected here (never announced, aborted, finished, or an older epoch) is dropped
and counted; it never touches the KV cache.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from core.messages import DecodeRequest, RequestKey
from core.timeline import Timeline
from kvtransfer import KVHeader, KVPayload


@dataclass(frozen=True)
class ReceivedKV:
    """K and V (`[layers, tokens, kv_heads, head_dim]`) of layers layer_start.. of the prompt
    tokens from token_start on, as received."""

    token_start: int
    layer_start: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class IncomingKV:
    request: DecodeRequest
    deadline: float  # the lease: past it, the KV is dropped and the request failed
    layers: list[ReceivedKV] = field(default_factory=list)
    next_layer: int = 0  # of the token range arriving now
    token_start: int = 0  # the token range arriving now: token_start..token_end-1
    token_end: int = 0
    timeline: Timeline = field(default_factory=Timeline)  # first_kv: its first chunk's arrival
    tokens: int = 0  # the leading prompt tokens whose KV comes (0: the whole prompt)

    @property
    def expected_tokens(self) -> int:
        return self.tokens or len(self.request.task.prompt_ids)


class IncomingTable:
    def __init__(self, num_layers: int, kv_dims: tuple[int, int], dtype: str, fingerprint: str,
                 lease_s: float) -> None:
        self.num_layers = num_layers
        self.kv_dims = kv_dims  # (kv_heads, head_dim)
        self.dtype = dtype
        self.fingerprint = fingerprint
        self.lease_s = lease_s
        self.pending: dict[RequestKey, IncomingKV] = {}
        self.dropped: Counter[str] = Counter()  # chunks, by reason
        self.expired = 0  # entries dropped because their lease ran out

    def expect(self, request: DecodeRequest, now: float, tokens: int = 0,
               lease_s: float | None = None) -> str | None:
        """Start collecting the request's KV (of its first `tokens` tokens, or 0: of its whole
        prompt) for `lease_s` (default: the table's) until its first chunk; why it cannot be
        taken, or None."""
        if request.fingerprint != self.fingerprint:
            return (f"KV layout mismatch: the prefill worker computed {request.fingerprint}, "
                    f"this decode worker holds {self.fingerprint}")
        older = [k for k in self.pending if k.request_id == request.request_id]
        if any(k.epoch > request.epoch for k in older):
            self.dropped["stale epoch"] += 1  # the request has moved on to a newer epoch
            return None
        for key in older:
            del self.pending[key]
        lease_s = self.lease_s if lease_s is None else lease_s
        self.pending[request.key] = IncomingKV(request, now + lease_s, tokens=tokens)
        return None

    def add(self, payload: KVPayload, now: float) -> str | None:
        """File a verified chunk, renewing its request's lease; why the request must fail,
        or None."""
        header = payload.header
        key = header.key
        entry = self.pending.get(key)
        if entry is None:
            stale = any(k.request_id == key.request_id and k.epoch > key.epoch
                        for k in self.pending)
            self.dropped["stale epoch" if stale else "unknown request"] += 1
            return None
        layers = header.layer_end - header.layer_start
        if (not self._in_order(entry, header) or header.layer_end > self.num_layers
                or header.shape != [layers, header.num_tokens, *self.kv_dims]
                or header.dtype != self.dtype):
            del self.pending[key]
            self.dropped["wrong shape"] += 1
            return "the KV did not match its request"
        k, v = payload.k, payload.v
        if payload.borrowed:  # it views the sender's buffer, which is released at the next drain
            k, v = k.clone(), v.clone()
        entry.layers.append(ReceivedKV(header.token_start, header.layer_start, k, v))
        entry.token_start = header.token_start
        entry.token_end = header.token_start + header.num_tokens
        entry.next_layer = header.layer_end
        entry.deadline = now + self.lease_s
        if entry.timeline.first_kv is None:
            entry.timeline.first_kv = now
        return None

    def _in_order(self, entry: IncomingKV, header: KVHeader) -> bool:
        """Whether the chunk is the next one due: the next layers of the token range arriving
        now, or, once that range has all its layers, the first layers of the next range."""
        if entry.next_layer in (0, self.num_layers):  # a new token range starts
            return (header.layer_start == 0 and header.token_start == entry.token_end
                    and header.token_start + header.num_tokens <= entry.expected_tokens)
        return (header.layer_start == entry.next_layer
                and header.token_start == entry.token_start
                and header.token_start + header.num_tokens == entry.token_end)

    def take(self, key: RequestKey) -> IncomingKV | None:
        """Stop collecting the request's KV and return what arrived (None if not expected)."""
        return self.pending.pop(key, None)

    def is_complete(self, entry: IncomingKV) -> bool:
        """Every layer of every token expected is in."""
        return entry.next_layer == self.num_layers and entry.token_end == entry.expected_tokens

    def expire(self, now: float) -> list[IncomingKV]:
        """Drop and return the entries whose lease ran out."""
        expired = [entry for entry in self.pending.values() if entry.deadline <= now]
        for entry in expired:
            del self.pending[entry.request.key]
        self.expired += len(expired)
        return expired
