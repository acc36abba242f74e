"""The decode side's table of KV on its way in: layer order, shapes, epochs, drops and leases."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from core.messages import DecodeRequest, GenerationTask, RequestKey, Sampling
from decode.incoming import IncomingTable
from kvtransfer import KVHeader, KVPayload

NUM_LAYERS = 3
KV_DIMS = (2, 4)  # (kv_heads, head_dim)
TOKENS = 5
LEASE_S = 10.0


@pytest.fixture
def table() -> IncomingTable:
    return IncomingTable(NUM_LAYERS, KV_DIMS, "float32", "fp-decode", LEASE_S)


def announce(request_id: str, epoch: int = 0, tokens: int = TOKENS,
             fingerprint: str = "fp-decode") -> DecodeRequest:
    task = GenerationTask(list(range(1, tokens + 1)), Sampling(temperature=0.0), 8, [], True)
    return DecodeRequest(request_id, epoch, task, fingerprint)


def chunk(request_id: str, layer_start: int, layer_end: int | None = None, epoch: int = 0,
          tokens: int = TOKENS, dims: tuple[int, int] = KV_DIMS, borrowed: bool = False,
          seed: int = 0, token_start: int = 0) -> KVPayload:
    """A chunk of layers layer_start..layer_end-1 of `tokens` tokens from token_start, whose
    header matches its tensors."""
    layer_end = layer_start + 1 if layer_end is None else layer_end
    shape = [layer_end - layer_start, tokens, *dims]
    generator = torch.Generator().manual_seed(seed)
    k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    header = KVHeader(request_id, epoch, layer_start, layer_end, tokens, "float32", shape, 0,
                      None, token_start)
    return KVPayload(header, k, v, borrowed=borrowed)


def test_a_complete_arrival_in_layer_order(table: IncomingTable) -> None:
    assert table.expect(announce("r"), now=0.0) is None
    sent = [chunk("r", 0, seed=0), chunk("r", 1, 3, seed=1)]  # a single layer, then two at once
    entry = table.pending[RequestKey("r", 0)]
    assert not table.is_complete(entry)
    for payload in sent:
        assert table.add(payload, now=0.0) is None
    assert table.is_complete(entry)
    taken = table.take(RequestKey("r", 0))
    assert taken is entry and table.pending == {}
    assert [(part.token_start, part.layer_start) for part in taken.layers] == [(0, 0), (0, 1)]
    for part, payload in zip(taken.layers, sent, strict=True):
        assert torch.equal(part.k, payload.k) and torch.equal(part.v, payload.v)
    assert table.take(RequestKey("r", 0)) is None
    assert sum(table.dropped.values()) == 0


def test_a_prompt_prefilled_in_chunks_arrives_range_by_range(table: IncomingTable) -> None:
    table.expect(announce("r"), now=0.0)
    entry = table.pending[RequestKey("r", 0)]
    for layer in range(NUM_LAYERS):  # tokens 0..1, every layer
        assert table.add(chunk("r", layer, tokens=2), now=0.0) is None
    assert not table.is_complete(entry)  # tokens 2..4 are still to come
    assert table.add(chunk("r", 0, 2, tokens=3, token_start=2), now=0.0) is None
    assert table.add(chunk("r", 2, tokens=3, token_start=2), now=0.0) is None
    assert table.is_complete(entry)
    spans = [(p.token_start, p.layer_start, p.k.shape[1]) for p in entry.layers]
    assert spans == [(0, 0, 2), (0, 1, 2), (0, 2, 2), (2, 0, 3), (2, 2, 3)]
    assert sum(table.dropped.values()) == 0


@pytest.mark.parametrize(("layers_before", "bad"), [
    pytest.param(NUM_LAYERS, {"token_start": 3, "tokens": 2}, id="skips-tokens"),
    pytest.param(NUM_LAYERS, {"token_start": 1, "tokens": 4}, id="repeats-tokens"),
    pytest.param(NUM_LAYERS, {"token_start": 2, "tokens": 4}, id="past-the-prompt"),
    pytest.param(1, {"token_start": 2, "tokens": 3}, id="next-range-before-the-last-layer"),
    pytest.param(1, {"layer_start": 1, "token_start": 0, "tokens": 3}, id="range-grows"),
])
def test_token_ranges_out_of_order_fail_the_request(
        table: IncomingTable, layers_before: int, bad: dict[str, Any]) -> None:
    table.expect(announce("r"), now=0.0)
    for layer in range(layers_before):
        assert table.add(chunk("r", layer, tokens=2), now=0.0) is None
    assert table.add(chunk("r", **{"layer_start": 0, **bad}), now=0.0)
    assert table.pending == {} and table.dropped == {"wrong shape": 1}


def test_a_chunk_for_an_unannounced_request_is_dropped_and_counted(table: IncomingTable) -> None:
    assert table.add(chunk("nobody", 0), now=0.0) is None  # no request to fail
    assert table.dropped == {"unknown request": 1}
    assert table.pending == {}


def test_a_chunk_of_an_older_epoch_is_dropped_as_stale(table: IncomingTable) -> None:
    table.expect(announce("r", epoch=2), now=0.0)
    assert table.add(chunk("r", 0, epoch=1), now=0.0) is None
    assert table.dropped == {"stale epoch": 1}
    entry = table.pending[RequestKey("r", 2)]
    assert entry.layers == [] and entry.next_layer == 0  # the newer epoch is untouched
    assert table.add(chunk("r", 0, epoch=2), now=0.0) is None
    assert entry.next_layer == 1


def test_expecting_a_newer_epoch_drops_the_older_one(table: IncomingTable) -> None:
    table.expect(announce("r", epoch=0), now=0.0)
    table.expect(announce("other"), now=0.0)
    table.add(chunk("r", 0, epoch=0), now=0.0)
    assert table.expect(announce("r", epoch=1), now=0.0) is None
    assert set(table.pending) == {("r", 1), ("other", 0)}
    assert table.pending[RequestKey("r", 1)].next_layer == 0  # starts afresh
    assert table.add(chunk("r", 1, epoch=0), now=0.0) is None  # the rest of the old epoch: dropped
    assert table.dropped == {"stale epoch": 1}


@pytest.mark.parametrize(("before", "bad"), [
    pytest.param(0, {"layer_start": 1}, id="skips-a-layer"),
    pytest.param(1, {"layer_start": 0}, id="repeats-a-layer"),
    pytest.param(2, {"layer_start": 2, "layer_end": 4}, id="past-the-last-layer"),
    pytest.param(1, {"layer_start": 1, "tokens": TOKENS - 1}, id="too-few-tokens"),
    pytest.param(1, {"layer_start": 1, "tokens": TOKENS + 1}, id="too-many-tokens"),
    pytest.param(0, {"dims": (KV_DIMS[0] + 1, KV_DIMS[1])}, id="wrong-kv-heads"),
    pytest.param(0, {"dims": (KV_DIMS[0], KV_DIMS[1] * 2)}, id="wrong-head-dim"),
])
def test_a_chunk_out_of_order_or_of_the_wrong_shape_fails_its_request(
        table: IncomingTable, before: int, bad: dict[str, Any]) -> None:
    table.expect(announce("r"), now=0.0)
    table.expect(announce("other"), now=0.0)
    for layer in range(before):  # well-formed layers first
        assert table.add(chunk("r", layer), now=0.0) is None
    reason = table.add(chunk("r", **{"layer_start": 0, **bad}), now=0.0)
    assert reason  # the request must fail, with a reason
    assert set(table.pending) == {("other", 0)}  # only that request, and its entry is gone
    assert table.dropped == {"wrong shape": 1}
    assert table.add(chunk("r", before), now=0.0) is None  # what follows finds no request
    assert table.dropped == {"wrong shape": 1, "unknown request": 1}


def test_a_fingerprint_mismatch_names_both_layouts(table: IncomingTable) -> None:
    reason = table.expect(announce("r", fingerprint="fp-prefill"), now=0.0)
    assert reason is not None
    assert "fp-prefill" in reason and "fp-decode" in reason
    assert table.pending == {}
    assert table.add(chunk("r", 0), now=0.0) is None
    assert table.dropped == {"unknown request": 1}


def test_a_borrowed_chunk_is_copied(table: IncomingTable) -> None:
    table.expect(announce("r"), now=0.0)
    payload = chunk("r", 0, borrowed=True)
    k_before, v_before = payload.k.clone(), payload.v.clone()
    table.add(payload, now=0.0)
    payload.k.fill_(7.0)  # the sender's buffer is reused after the drain
    payload.v.fill_(7.0)
    (part,) = table.pending[RequestKey("r", 0)].layers
    k, v = part.k, part.v
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_an_owned_chunk_is_kept_as_is(table: IncomingTable) -> None:
    table.expect(announce("r"), now=0.0)
    payload = chunk("r", 0, borrowed=False)
    table.add(payload, now=0.0)
    (part,) = table.pending[RequestKey("r", 0)].layers
    assert part.k is payload.k and part.v is payload.v  # no copy: the receiver gave it away


def test_expire_drops_only_entries_past_their_lease(table: IncomingTable) -> None:
    table.expect(announce("early"), now=0.0)
    table.expect(announce("late"), now=5.0)
    assert table.expire(now=LEASE_S - 0.001) == []
    assert [e.request.request_id for e in table.expire(now=LEASE_S)] == ["early"]
    assert set(table.pending) == {("late", 0)}
    assert table.expire(now=LEASE_S + 1.0) == []
    assert [e.request.request_id for e in table.expire(now=LEASE_S + 5.0)] == ["late"]
    assert table.pending == {}


def test_an_expired_request_drops_its_late_chunks(table: IncomingTable) -> None:
    table.expect(announce("r"), now=0.0)
    table.expire(now=LEASE_S + 1.0)
    assert table.add(chunk("r", 0), now=0.0) is None
    assert table.dropped == {"unknown request": 1}


def test_a_late_notice_of_an_older_epoch_leaves_the_newer_one_alone(table: IncomingTable) -> None:
    table.expect(announce("r", epoch=3), now=0.0)
    assert table.expect(announce("r", epoch=1), now=0.0) is None
    assert list(table.pending) == [("r", 3)] and table.dropped == {"stale epoch": 1}


def test_a_chunk_of_a_newer_epoch_than_expected_is_unknown_not_stale(table: IncomingTable) -> None:
    table.expect(announce("r", epoch=0), now=0.0)
    assert table.add(chunk("r", 0, epoch=5), now=0.0) is None
    assert table.dropped == {"unknown request": 1}


def test_each_arriving_chunk_renews_the_lease(table: IncomingTable) -> None:
    """A long prompt prefilled in chunks may take longer than one lease to arrive in full."""
    table.expect(announce("r"), now=0.0)
    assert table.add(chunk("r", 0), now=LEASE_S - 1.0) is None
    assert table.expire(now=LEASE_S + 1.0) == []
    assert [e.request.request_id for e in table.expire(now=2 * LEASE_S - 1.0)] == ["r"]


def test_a_pulled_prefix_is_complete_at_its_own_length(table: IncomingTable) -> None:
    request = announce("r", tokens=12)
    assert table.expect(request, now=0.0, tokens=8, lease_s=1.0) is None
    entry = table.pending[request.key]
    assert entry.deadline == 1.0  # its own lease, not the table's
    entry.tokens = 4  # the holder had four of them cached
    assert table.add(chunk("r", 0, 3, tokens=4), now=0.5) is None
    assert table.is_complete(entry) and entry.deadline == 0.5 + LEASE_S  # renewed as ever


def test_a_pulled_prefix_longer_than_announced_does_not_fit(table: IncomingTable) -> None:
    request = announce("r", tokens=12)
    assert table.expect(request, now=0.0, tokens=8) is None
    assert table.add(chunk("r", 0, 3, tokens=9), now=0.0) == "the KV did not match its request"
    assert request.key not in table.pending and table.dropped["wrong shape"] == 1
