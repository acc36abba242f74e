"""Handing prompts' KV to decode workers layer by layer, while the forward passes run.

Per request, in order on one pipe: a `DecodeRequest` notice before its first chunk is computed,
then for each prefill chunk (one when the prompt is prefilled in one pass) its K/V in chunks of
layers as soon as the model has written them, and the `FirstToken` once sampled after the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.messages import DecodeRequest, FirstToken, PrefillRequest, RequestKey, encode
from engine.kv.cache import PagedKVCache
from kvtransfer import KVSender, TransferError
from kvtransfer.sender import layers_per_chunk


@dataclass
class _Outgoing:
    request: PrefillRequest
    table: list[int]
    sent: int = 0  # tokens whose every layer went out
    end: int = 0  # the tokens computed in this step end here (0: none in this step)
    layers_per_chunk: int = 1
    next_layer: int = 0  # the first layer of this step's tokens not sent yet
    failure: str | None = None  # why its KV could not be sent
    aborted: bool = False


class LayerStream:
    """The KV of the prompts in progress on their way out, step after step. A send that fails
    marks only its own request."""

    def __init__(self, sender: KVSender, cache: PagedKVCache, fingerprint: str,
                 chunk_bytes: int, host: str = "") -> None:
        """`host`: this worker's; KV for a decode worker on another host goes inline (a
        staging buffer of this host is out of its reach)."""
        self.sender = sender
        self.cache = cache
        self.fingerprint = fingerprint
        self.chunk_bytes = chunk_bytes
        self.host = host
        self.outgoing: dict[RequestKey, _Outgoing] = {}

    def start(self, request: PrefillRequest, table: list[int]) -> None:
        """Announce the request to its decode worker, before any of its KV is computed."""
        out = _Outgoing(request, table)
        self.outgoing[request.key] = out
        notice = DecodeRequest(request.request_id, request.epoch, request.task, self.fingerprint,
                               request.siblings, request.traceparent)
        self._notify(out, encode(notice))

    def begin_step(self, ends: dict[RequestKey, int]) -> None:
        """This step computes the given requests' tokens up to `ends[key]`: their tokens not
        sent yet (a cached prefix included) go out with the step's layers."""
        for key, out in self.outgoing.items():
            out.end = ends.get(key, 0)
            out.next_layer = 0
            if out.end:
                assert out.end > out.sent, "a step computes tokens not sent yet"
                bytes_per_layer = (out.end - out.sent) * self.cache.bytes_per_token
                out.layers_per_chunk = layers_per_chunk(bytes_per_layer // self.cache.num_layers,
                                                        self.chunk_bytes)

    def send_layer(self, layer: int) -> None:
        """The model just wrote layer `layer`: send what is due (a chunk of layers is due when
        it is full or holds the last layer)."""
        last = layer == self.cache.num_layers - 1
        for out in self.outgoing.values():
            stopped = out.failure is not None or out.aborted
            if stopped or not out.end or not (
                    last or layer + 1 - out.next_layer >= out.layers_per_chunk):
                continue
            self._send(out, layer + 1)
            if last:
                out.sent, out.end = out.end, 0

    def _send(self, out: _Outgoing, layer_end: int) -> None:
        request = out.request
        k, v = self.cache.read_layers(out.next_layer, layer_end, out.table, out.end, out.sent)
        try:
            self.sender.send_layers(request.decode_address, request.request_id,
                                    request.epoch, out.next_layer, k, v, out.sent,
                                    stage=request.decode_host in ("", self.host))
        except TransferError as exc:
            out.failure = str(exc)
        out.next_layer = layer_end

    def abort(self, key: RequestKey) -> None:
        """Send nothing more for the request `key` (its decode worker hears of it from the
        gateway and drops what already arrived)."""
        out = self.outgoing.get(key)
        if out is not None:
            out.aborted = True

    def broken(self) -> dict[RequestKey, str]:
        """The requests whose KV could not be sent, and why (the aborted ones aside)."""
        return {key: out.failure for key, out in self.outgoing.items()
                if out.failure is not None and not out.aborted}

    def forget(self, key: RequestKey) -> None:
        """Drop the request (aborted, or failed before its first token)."""
        self.outgoing.pop(key, None)

    def finish(self, first: FirstToken) -> str | None:
        """Send the first token after the last layer and forget the request; why its hand-off
        failed, if it did."""
        out = self.outgoing.pop(first.key, None)
        if out is None:
            return None
        assert out.failure is not None or out.sent == len(out.request.task.prompt_ids)
        if out.failure is None:
            self._notify(out, encode(first))
        return out.failure

    def _notify(self, out: _Outgoing, meta: bytes) -> None:
        request = out.request
        try:
            self.sender.notify(request.decode_address, request.request_id, request.epoch, meta)
        except TransferError as exc:
            out.failure = str(exc)
