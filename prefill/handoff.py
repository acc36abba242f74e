"""Handing a prefill batch's KV to decode workers layer by layer, while the forward pass runs.

Per request, in order on one pipe: a `DecodeRequest` notice before the forward pass, its K/V
in chunks of layers as soon as the model has written them, and the `FirstToken` once sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.messages import DecodeRequest, FirstToken, PrefillRequest, encode
from engine.kv_cache import PagedKVCache
from kvtransfer import KVSender, TransferError
from kvtransfer.sender import layers_per_chunk


@dataclass
class _Outgoing:
    request: PrefillRequest
    table: list[int]
    layers_per_chunk: int
    next_layer: int = 0  # the first layer not sent yet
    failure: str | None = None


class LayerStream:
    """One batch's KV on its way out. A send that fails marks only its own request."""

    def __init__(self, sender: KVSender, cache: PagedKVCache, fingerprint: str,
                 requests: list[tuple[PrefillRequest, list[int]]], chunk_bytes: int) -> None:
        self.sender = sender
        self.cache = cache
        self.outgoing = {
            (r.request_id, r.epoch): _Outgoing(r, t, layers_per_chunk(
                len(r.task.prompt_ids) * cache.bytes_per_token // cache.num_layers, chunk_bytes))
            for r, t in requests}
        for out in self.outgoing.values():
            request = out.request
            notice = DecodeRequest(request.request_id, request.epoch, request.task, fingerprint)
            self._notify(out, encode(notice))

    def send_layer(self, layer: int) -> None:
        """The model just wrote layer `layer`: send what is due (a chunk of layers is due when
        it is full or holds the last layer)."""
        last = layer == self.cache.num_layers - 1
        for out in self.outgoing.values():
            if out.failure is not None or not (
                    last or layer + 1 - out.next_layer >= out.layers_per_chunk):
                continue
            request = out.request
            k, v = self.cache.read_layers(out.next_layer, layer + 1, out.table,
                                          len(request.task.prompt_ids))
            try:
                self.sender.send_layers(request.decode_address, request.request_id,
                                        request.epoch, out.next_layer, k, v)
            except TransferError as exc:
                out.failure = str(exc)
            out.next_layer = layer + 1

    def abort(self, key: tuple[str, int]) -> None:
        """Send nothing more for the request `key` (its decode worker hears of it from the
        gateway and drops what already arrived)."""
        out = self.outgoing.get(key)
        if out is not None and out.failure is None:
            out.failure = "aborted"

    def finish(self, first: FirstToken) -> str | None:
        """Send the first token after the last layer; why the hand-off failed, if it did."""
        out = self.outgoing.get((first.request_id, first.epoch))
        if out is None:
            return None
        if out.failure is None:
            self._notify(out, encode(first))
        return out.failure

    def _notify(self, out: _Outgoing, meta: bytes) -> None:
        request = out.request
        try:
            self.sender.notify(request.decode_address, request.request_id, request.epoch, meta)
        except TransferError as exc:
            out.failure = str(exc)
