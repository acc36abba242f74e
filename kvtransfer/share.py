"""The holder's side of a pull: a worker sends the KV of a prefix its cache holds to a decode
worker that prefills the rest of a prompt (the gateway asks, `SharePrefix`; the decode worker's
side is decode/pulls.py).

The same wire as a prefill hand-off: a `SharedPrefix` notice naming how many tokens follow, then
their K and V in chunks of layers, checksummed and tagged with the request's epoch. The blocks
are pinned (a reference held) while they are read, so that no eviction reuses them meanwhile.
"""

from __future__ import annotations

import logging

from core.logs import about
from core.messages import SharedPrefix, SharePrefix, encode
from engine.kv.block_hash import block_hashes
from engine.kv.cache import PagedKVCache
from engine.kv.prefix_cache import PrefixCache
from kvtransfer import KVSender, TransferError
from kvtransfer.sender import layers_per_chunk

log = logging.getLogger(__name__)


def share_prefix(asked: SharePrefix, cache: PrefixCache, kv: PagedKVCache, sender: KVSender,
                 fingerprint: str, chunk_bytes: int, host: str) -> int:
    """Send the KV of the longest cached prefix of the asked tokens (whole blocks); return how
    many tokens that was (0: none cached here, which the notice says). A decode worker that
    cannot be reached is logged, and computes the prefix itself once its lease runs out."""
    try:
        tokens = _send(asked, cache, kv, sender, fingerprint, chunk_bytes, host)
    except TransferError as error:
        log.warning("request %s: its prefix could not be shared with %s: %s",
                    asked.request_id, asked.worker, error, extra=about(asked.key))
        return 0
    log.info("request %s: shared %d cached tokens with %s", asked.request_id, tokens,
             asked.worker, extra=about(asked.key))
    return tokens


def _send(asked: SharePrefix, cache: PrefixCache, kv: PagedKVCache, sender: KVSender,
          fingerprint: str, chunk_bytes: int, host: str) -> int:
    chain = block_hashes(asked.prompt_ids[:asked.num_tokens], kv.block_size, asked.cache_salt)
    blocks = cache.match(chain)
    try:
        tokens = len(blocks) * kv.block_size
        sender.notify(asked.address, asked.request_id, asked.epoch,
                      encode(SharedPrefix(asked.request_id, asked.epoch, tokens, fingerprint)))
        if tokens:
            per_chunk = layers_per_chunk(tokens * kv.bytes_per_token // kv.num_layers,
                                         chunk_bytes)
            for start in range(0, kv.num_layers, per_chunk):
                end = min(start + per_chunk, kv.num_layers)
                k, v = kv.read_layers(start, end, blocks, tokens)
                sender.send_layers(asked.address, asked.request_id, asked.epoch, start, k, v,
                                   stage=asked.host in ("", host))
    finally:
        cache.release(blocks)
    return tokens
