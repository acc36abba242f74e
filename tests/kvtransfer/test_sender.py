"""KVSender over plain ZeroMQ (tcp and ipc): exact round trips, order kept with the notices, one
socket per address, and sends that fail fast and leave the sender usable."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from core.config import KVBackend, KVTransferConfig
from kvtransfer import (
    KVNotice,
    KVPayload,
    KVReceiver,
    KVSender,
    TransferError,
    make_receiver,
    make_sender,
)
from kvtransfer.sender import StagedKVSender
from kvtransfer.wire import KVItem, dtype_name
from tests.kvtransfer.conftest import (
    DTYPES,
    SHAPE,
    WAIT_S,
    is_payload_of,
    kv,
    payloads,
    receive,
    receive_nothing_more,
)


def summary(item: KVItem) -> tuple[str, str, int]:
    """What arrived, in a form that compares: (kind, request, epoch or layer)."""
    if isinstance(item, KVNotice):
        return "notice", item.request_id, item.epoch
    if isinstance(item, KVPayload):
        return "chunk", item.header.request_id, item.header.layer_start
    return "rejected", item.request_id, item.epoch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact(receiver: KVReceiver, sender: KVSender, dtype: torch.dtype) -> None:
    k, v = kv(0, dtype)
    sender.send_layers(receiver.address, "r1", 3, 4, k, v, token_start=64)
    (payload,) = payloads(receive(receiver, 1))
    assert payload.k.dtype == dtype and payload.v.dtype == dtype
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert payload.key == ("r1", 3) and not payload.borrowed
    header = payload.header
    assert (header.layer_start, header.layer_end, header.num_tokens) == (4, 6, 5)
    assert header.token_start == 64
    assert header.shape == list(SHAPE) and header.dtype == dtype_name(dtype)
    assert header.placement is None
    assert receiver.rejected == 0


def test_a_large_chunk_round_trips(receiver: KVReceiver, sender: KVSender) -> None:
    k, v = kv(1, torch.bfloat16, (30, 300, 3, 64))  # ~3.5 MB each, sent without copying
    sender.send_layers(receiver.address, "big", 0, 0, k, v)
    (payload,) = payloads(receive(receiver, 1))
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)


def test_a_notice_arrives_as_sent(receiver: KVReceiver, sender: KVSender) -> None:
    sender.notify(receiver.address, "r1", 2, b"\x00meta\xff")
    assert receive(receiver, 1) == [KVNotice("r1", 2, b"\x00meta\xff")]
    assert receiver.counters.chunks == 0  # notices are not chunks


def test_chunks_and_notices_keep_their_order(receiver: KVReceiver, sender: KVSender) -> None:
    """The prefill side's sequence per request: a notice, each layer, a closing notice."""
    sent: list[tuple[str, str, int]] = []
    for request in ("a", "b"):
        sender.notify(receiver.address, request, 0, b"start")
        sent.append(("notice", request, 0))
    for layer in range(6):
        for request in ("a", "b"):
            sender.send_layers(receiver.address, request, 0, layer, *kv(layer, shape=(1, 4, 2, 8)))
            sent.append(("chunk", request, layer))
    for request in ("b", "a"):
        sender.notify(receiver.address, request, 0, b"end")
        sent.append(("notice", request, 0))
    got = receive(receiver, len(sent))
    assert [summary(item) for item in got] == sent
    metas = [item.meta for item in got if isinstance(item, KVNotice)]
    assert metas == [b"start", b"start", b"end", b"end"]
    for item in payloads([item for item in got if isinstance(item, KVPayload)]):
        k, v = kv(item.header.layer_start, shape=(1, 4, 2, 8))
        assert torch.equal(item.k, k) and torch.equal(item.v, v)
    assert receive_nothing_more(receiver) == []


def test_many_chunks_from_two_senders_all_arrive_in_each_senders_order(
    context: zmq.Context, receiver: KVReceiver,
) -> None:
    senders = [make_sender(context), make_sender(context)]
    sent: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for i in range(60):
            request_id = f"s{i % 2}-{i}"
            sent[request_id] = kv(i, torch.bfloat16 if i % 3 else torch.float32)
            senders[i % 2].send_layers(receiver.address, request_id, i, 0, *sent[request_id])
        got = payloads(receive(receiver, len(sent)))
    finally:
        for sender in senders:
            sender.close()
    assert sorted(p.header.request_id for p in got) == sorted(sent)
    for payload in got:
        k, v = sent[payload.header.request_id]
        assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    for prefix in ("s0-", "s1-"):
        epochs = [p.header.epoch for p in got if p.header.request_id.startswith(prefix)]
        assert epochs == sorted(epochs) and len(epochs) == 30
    assert receive_nothing_more(receiver) == [] and receiver.rejected == 0


def test_counters_advance_on_both_sides(receiver: KVReceiver, sender: KVSender) -> None:
    k, v = kv(2)
    nbytes = k.nbytes + v.nbytes
    for i in range(3):
        sender.send_layers(receiver.address, "r", 0, i, k, v)
    sender.notify(receiver.address, "r", 0, b"done")
    receive(receiver, 4)
    for counters in (sender.counters, receiver.counters):
        assert (counters.chunks, counters.bytes, counters.failures) == (3, 3 * nbytes, 0)
        assert counters.seconds > 0


def test_the_receiver_address_is_concrete(receiver: KVReceiver) -> None:
    assert "*" not in receiver.address
    assert receiver.address.startswith(("tcp://127.0.0.1:", "ipc://"))


def test_the_sender_keeps_one_socket_per_address(
    context: zmq.Context, receiver: KVReceiver, sender: KVSender,
) -> None:
    other = make_receiver(context, "tcp://127.0.0.1:*")
    try:
        k, v = kv(11)
        for address in (receiver.address, other.address, receiver.address):
            sender.send_layers(address, "r", 0, 0, k, v)
        sender.notify(other.address, "r", 0, b"")
        assert len(receive(receiver, 2)) == 2 and len(receive(other, 2)) == 2
        assert sorted(sender.sockets) == sorted([receiver.address, other.address])
        assert all(s.type == zmq.DEALER for s in sender.sockets.values())
    finally:
        other.close()


def test_make_sender_without_a_config_or_for_zmq_is_the_inline_sender(
    context: zmq.Context,
) -> None:
    for config in (None, KVTransferConfig(backend="zmq")):
        sender = make_sender(context, config)
        try:
            assert type(sender) is KVSender and sender.backend == "zmq"
            assert not isinstance(sender, StagedKVSender)
        finally:
            sender.close()


@pytest.fixture
def dead_tcp_address() -> Iterator[str]:
    """A tcp address where nothing listens: the port is held (bound, never listening), so no
    other test or process can take it meanwhile, and connections to it are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{held.getsockname()[1]}"


def test_sending_where_nothing_listens_raises_soon_and_leaves_the_sender_usable(
    context: zmq.Context, sender: KVSender, tmp_path: Path, dead_tcp_address: str,
) -> None:
    k, v = kv(12)
    sends = [  # each address kind, each call (every failure waits out the 2 s connect grace)
        lambda: sender.send_layers(dead_tcp_address, "r", 0, 0, k, v),
        lambda: sender.notify(f"ipc://{tmp_path}/nobody", "r", 0, b""),
    ]
    for send in sends:
        started = time.monotonic()
        with pytest.raises(TransferError, match="not reachable"):
            send()
        assert time.monotonic() - started < 3.0
    assert (sender.counters.chunks, sender.counters.bytes, sender.counters.failures) == (0, 0, 2)
    live = make_receiver(context, "tcp://127.0.0.1:*")
    try:
        sender.send_layers(live.address, "kept", 0, 0, k, v)
        assert [p.header.request_id for p in payloads(receive(live, 1))] == ["kept"]
        assert sender.counters.chunks == 1
    finally:
        live.close()


def test_a_peer_that_accepts_and_never_speaks_fails_the_send_soon(sender: KVSender) -> None:
    """A listener that takes the connection but never answers ZeroMQ's handshake (a wedged
    process, a wrong service on the port): the send fails as unreachable within the connect
    grace rather than waiting on it for good, and counts as a failure."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # the kernel completes the TCP handshake; nobody ever reads or writes
        k, v = kv(12)
        started = time.monotonic()
        with pytest.raises(TransferError, match="not reachable"):
            sender.send_layers(f"tcp://127.0.0.1:{mute.getsockname()[1]}", "r", 0, 0, k, v)
        assert time.monotonic() - started < 3.0
    assert (sender.counters.chunks, sender.counters.failures) == (0, 1)


def test_a_receiver_given_up_on_fails_the_next_sends_at_once_until_it_is_back(
    context: zmq.Context, sender: KVSender,
) -> None:
    """The connect wait stalls the prefill loop: it is paid once per lost receiver, not per
    request sent its way, and heartbeats go on during it; a receiver back at its address is
    sent to again."""
    receiver = make_receiver(context, "tcp://127.0.0.1:*")
    address = receiver.address
    sender.send_layers(address, "before", 0, 0, *kv(2))
    receiver.close()
    until_writable(sender, address, False)
    waits, beats = [], []
    sender.while_waiting = lambda: beats.append(time.monotonic())
    for request_id in ("first", "second", "third"):
        started = time.monotonic()
        with pytest.raises(TransferError, match="not reachable"):
            sender.notify(address, request_id, 0, b"")
        waits.append(time.monotonic() - started)
    assert waits[0] > 1.5 and max(waits[1:]) < 0.1, waits
    # The wait is in slices, the worker's heartbeat between them: no gap near a timeout.
    assert len(beats) >= 10 and max(b - a for a, b in itertools.pairwise(beats)) < 0.5
    back = make_receiver(context, address)
    try:
        until_writable(sender, address, True)  # the socket reconnects by itself
        sender.send_layers(address, "after", 0, 0, *kv(2))
        assert [p.header.request_id for p in payloads(receive(back, 1))] == ["after"]
        assert address not in sender.unreachable
    finally:
        back.close()


def until_writable(sender: KVSender, address: str, writable: bool) -> None:
    deadline = time.monotonic() + 5
    while bool(sender.sockets[address].poll(0, zmq.POLLOUT)) != writable:
        assert time.monotonic() < deadline, f"the socket to {address} never became {writable}"
        time.sleep(0.01)


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_a_receiver_gone_between_poll_and_send_fails_the_send_at_once(
    context: zmq.Context, receiver: KVReceiver, backend: KVBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The socket can poll writable a moment before a dying receiver's pipe goes: the send must
    then fail (the prefill worker fails the hand-off over) rather than wait for a peer that is
    gone, which hung a prefill worker's loop for good; a staged chunk's region is freed."""
    sender = make_sender(context, KVTransferConfig(backend=backend))
    try:
        k, v = kv(13)
        sender.send_layers(receiver.address, "before", 0, 0, k, v)
        assert len(receive(receiver, 1)) == 1
        receiver.close()
        until_writable(sender, receiver.address, False)
        monkeypatch.setattr(sender, "_writable", sender._socket)  # as if poll had said writable
        staged = sender.ring.in_use if isinstance(sender, StagedKVSender) else 0
        with pytest.raises(TransferError, match="went away"):
            sender.send_layers(receiver.address, "lost", 0, 0, k, v)
        assert sender.counters.failures == 1
        if isinstance(sender, StagedKVSender):
            assert sender.ring.in_use == staged
    finally:
        sender.close()


def test_a_dead_receiver_does_not_take_the_chunk(
    context: zmq.Context, sender: KVSender, receiver: KVReceiver,
) -> None:
    """Nothing queues for a receiver that went away; the next one at its address gets only
    what was sent to it."""
    k, v = kv(13)
    sender.send_layers(receiver.address, "before", 0, 0, k, v)
    assert [p.header.request_id for p in payloads(receive(receiver, 1))] == ["before"]
    address = receiver.address
    receiver.close()
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(TransferError):  # once the sender notices the peer is gone
        while time.monotonic() < deadline:
            sender.send_layers(address, "lost", 0, 0, k, v)
            time.sleep(0.01)
    if address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
    again = make_receiver(context, address)
    try:
        until_writable(sender, address, True)  # given up on: no connect wait is granted now
        sender.send_layers(address, "after", 0, 0, k, v)
        got = receive(again, 1, until=is_payload_of("after")) + receive_nothing_more(again)
        assert [p.header.request_id for p in payloads(got)] == ["after"]
    finally:
        again.close()
