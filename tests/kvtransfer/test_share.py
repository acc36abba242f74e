"""The holder's side of a pull, over a real sender and receiver: the notice says how many
cached tokens follow, their K and V arrive as the cache holds them, in chunks of layers, and
the blocks pinned for the read are let go after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import zmq

from core.messages import SharedPrefix, SharePrefix, decode
from engine.kv.allocator import BlockAllocator
from engine.kv.block_hash import block_hashes
from engine.kv.cache import PagedKVCache
from engine.kv.prefix_cache import PrefixCache
from engine.weights.spec import ModelSpec
from kvtransfer import KVNotice, KVReceiver, make_receiver, make_sender
from kvtransfer.share import share_prefix
from tests.kvtransfer.conftest import payloads, receive

BLOCK = 4
SPEC = ModelSpec(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=5,
                 num_heads=2, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                 rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_ids=(2,), name="tiny")
PROMPT = list(range(10, 24))  # 14 tokens: three full blocks, and two tokens more


@pytest.fixture
def receiver(context: zmq.Context) -> Iterator[KVReceiver]:
    receiver = make_receiver(context, "tcp://127.0.0.1:*")
    yield receiver
    receiver.close()


def holder() -> tuple[PrefixCache, PagedKVCache, list[int]]:
    """A cache holding PROMPT's three full blocks under salt "a", with KV of its own."""
    allocator = BlockAllocator(8)
    cache, kv = PrefixCache(allocator), PagedKVCache(SPEC, 8, BLOCK, torch.float32)
    blocks = allocator.allocate(4)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    cache.insert(block_hashes(PROMPT, BLOCK, "a"), blocks)
    cache.release(blocks)  # the request that computed them ended: idle, cached
    return cache, kv, blocks


def asked(receiver: KVReceiver, salt: str = "a", tokens: int = 13) -> SharePrefix:
    return SharePrefix("r", 2, PROMPT, salt, tokens, "holder-0", "decode-1", receiver.address)


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20], ids=["a layer a chunk", "one chunk"])
def test_the_cached_blocks_kv_goes_out_after_a_notice(receiver: KVReceiver, context: zmq.Context,
                                                      chunk_bytes: int) -> None:
    cache, kv, blocks = holder()
    sender = make_sender(context)
    try:
        sent = share_prefix(asked(receiver), cache, kv, sender, "fp", chunk_bytes, "")
    finally:
        sender.close()
    assert sent == 12  # three whole blocks of the 13 asked for
    chunks = 5 if chunk_bytes == 1 else 1
    notice, *rest = receive(receiver, 1 + chunks)
    assert isinstance(notice, KVNotice) and decode(notice.meta) == SharedPrefix("r", 2, 12, "fp")
    k = torch.cat([p.k for p in payloads(rest)])
    v = torch.cat([p.v for p in payloads(rest)])
    expected_k, expected_v = kv.read(blocks, 12)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    assert all(p.key == ("r", 2) and p.header.token_start == 0 for p in payloads(rest))
    assert [cache.allocator.ref_count(b) for b in blocks[:3]] == [1, 1, 1]  # the cache's own


def test_another_tenants_prefix_is_not_shared(receiver: KVReceiver, context: zmq.Context) -> None:
    cache, kv, _ = holder()
    sender = make_sender(context)
    try:
        assert share_prefix(asked(receiver, salt="b"), cache, kv, sender, "fp", 1, "") == 0
    finally:
        sender.close()
    (notice,) = receive(receiver, 1)
    assert isinstance(notice, KVNotice) and decode(notice.meta) == SharedPrefix("r", 2, 0, "fp")
