"""KV over ZeroMQ: exact round trips, and every corrupt chunk dropped and counted, never raised."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from core.messages import DecodeRequest, GenerationTask, Sampling, decode, encode
from kvtransfer import KVPayload, KVReceiver, KVSender, make_receiver, make_sender
from kvtransfer.base import TransferError
from kvtransfer.wire import HEADER_CODEC, KVHeader, KVRejected, as_bytes, checksum, dtype_name

WAIT_S = 5.0
SHAPE = (2, 5, 3, 8)  # [layers, tokens, kv_heads, head_dim]


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["tcp", "ipc"])
def bind(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "tcp":
        return "tcp://127.0.0.1:*"
    path = tmp_path / "kv.sock"
    assert len(str(path)) < 100, "ipc paths are limited to ~107 bytes"
    return f"ipc://{path}"


@pytest.fixture
def receiver(context: zmq.Context, bind: str) -> Iterator[KVReceiver]:
    receiver = make_receiver(context, bind)
    yield receiver
    receiver.close()


@pytest.fixture
def sender(context: zmq.Context) -> Iterator[KVSender]:
    sender = make_sender(context)
    yield sender
    sender.close()


def receive(receiver: KVReceiver, count: int) -> list[KVPayload]:
    """Poll and drain until `count` verified chunks arrived."""
    got: list[KVPayload] = []
    deadline = time.monotonic() + WAIT_S
    socket = receiver.fileno_socket()
    while len(got) < count:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        assert remaining_ms > 0, f"only {len(got)} of {count} chunks arrived"
        socket.poll(min(remaining_ms, 100))  # type: ignore[attr-defined]
        got += receiver.drain()
    return got


def receive_nothing_more(receiver: KVReceiver) -> list[KVPayload]:
    time.sleep(0.1)
    return receiver.drain()


def kv(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE,
       ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k, v


def meta(request_id: str) -> bytes:
    task = GenerationTask([1, 2, 3, 4, 5], Sampling(seed=3), 8, [2], False)
    return encode(DecodeRequest(request_id, 0, task, 42))


def header_for(k: torch.Tensor, v: torch.Tensor, **changes: object) -> bytes:
    fields: dict[str, object] = {
        "request_id": "r", "epoch": 0, "layer_start": 0, "layer_end": k.shape[0],
        "num_tokens": k.shape[1], "dtype": dtype_name(k.dtype), "shape": list(k.shape),
        "checksum": checksum(as_bytes(k), as_bytes(v)), "meta": b"",
    }
    return HEADER_CODEC.encode(KVHeader(**{**fields, **changes}))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_is_exact(receiver: KVReceiver, sender: KVSender, dtype: torch.dtype) -> None:
    k, v = kv(0, dtype)
    sender.send(receiver.address, "r1", 3, meta("r1"), k, v, layer_start=4)
    (payload,) = receive(receiver, 1)
    assert payload.k.dtype == dtype and payload.v.dtype == dtype
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    header = payload.header
    assert (header.request_id, header.epoch) == ("r1", 3)
    assert (header.layer_start, header.layer_end, header.num_tokens) == (4, 6, 5)
    assert header.shape == list(SHAPE) and header.dtype == dtype_name(dtype)
    assert header.meta == meta("r1") and decode(header.meta) == decode(meta("r1"))
    assert receiver.rejected == 0 and receiver.take_rejections() == []


def test_a_large_chunk_round_trips_zero_copy(receiver: KVReceiver, sender: KVSender) -> None:
    k, v = kv(1, torch.bfloat16, (30, 300, 3, 64))  # ~3.5 MB each: sent without copying
    sender.send(receiver.address, "big", 0, b"", k, v)
    (payload,) = receive(receiver, 1)
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)


def test_the_receiver_address_is_concrete(receiver: KVReceiver) -> None:
    assert "*" not in receiver.address
    assert receiver.address.startswith(("tcp://127.0.0.1:", "ipc://"))


def test_many_chunks_from_two_senders_all_arrive(
    context: zmq.Context, receiver: KVReceiver
) -> None:
    senders = [make_sender(context), make_sender(context)]
    sent: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(60):
        request_id = f"s{i % 2}-{i}"
        sent[request_id] = kv(i, torch.bfloat16 if i % 3 else torch.float32)
        senders[i % 2].send(receiver.address, request_id, i, meta(request_id), *sent[request_id])
    got = receive(receiver, len(sent))
    assert sorted(p.header.request_id for p in got) == sorted(sent)
    for payload in got:
        k, v = sent[payload.header.request_id]
        assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
        assert payload.header.meta == meta(payload.header.request_id)
    per_sender = [[p.header.epoch for p in got if p.header.request_id.startswith(f"s{s}")]
                  for s in (0, 1)]
    assert all(epochs == sorted(epochs) for epochs in per_sender)  # each sender's order kept
    assert receive_nothing_more(receiver) == [] and receiver.rejected == 0
    for sender in senders:
        sender.close()


BAD_ID, BAD_EPOCH = "bad", 5


def _bad_chunks() -> dict[str, list[bytes]]:
    k, v = kv(7)
    kb, vb = bytes(as_bytes(k)), bytes(as_bytes(v))
    small_k, small_v = kv(8, shape=(1, 1, 1, 3))
    corrupted = bytearray(vb)
    corrupted[10] ^= 0x01

    def bad(k: torch.Tensor, v: torch.Tensor, **changes: object) -> bytes:
        """A header that decodes and names its request."""
        return header_for(k, v, **{"request_id": BAD_ID, "epoch": BAD_EPOCH, **changes})

    return {
        "bad checksum": [bad(k, v, checksum=checksum(as_bytes(k), as_bytes(v)) ^ 1), kb, vb],
        "corrupted buffer": [bad(k, v), kb, bytes(corrupted)],
        "garbage header": [b"not a header", kb, vb],
        "empty header": [b"", kb, vb],
        "control message as header": [meta("r"), kb, vb],
        "too few frames": [bad(k, v), kb],
        "too many frames": [bad(k, v), kb, vb, vb],
        "one frame": [bad(k, v)],
        "unknown dtype": [bad(k, v, dtype="int8"), kb, vb],
        "shape too big": [bad(small_k, small_v, shape=[2, 2, 2, 2]),
                          bytes(as_bytes(small_k)), bytes(as_bytes(small_v))],
        "shape too small": [bad(k, v, shape=[1, 5, 3, 8]), kb, vb],
        "layers not as the header says": [bad(k, v, layer_start=3, layer_end=4), kb, vb],
        "tokens not as the header says": [bad(k, v, num_tokens=4), kb, vb],
        "negative shape": [bad(k, v, shape=[-2, 5, 3, 8]), kb, vb],
        "negative inner dims": [bad(k, v, shape=[2, 5, -3, -8]), kb, vb],  # right element count
        "inner dims do not fit": [bad(k, v, shape=[2, 5, 3, 9]), kb, vb],
        "inner dims too small": [bad(k, v, shape=[2, 5, 3, 4]), kb, vb],
        "buffer not a whole element": [bad(k, v, checksum=checksum(b"abc", b"abc")),
                                       b"abc", b"abc"],
        "empty buffers": [bad(k, v, checksum=0), b"", b""],
    }


BAD_CHUNKS = _bad_chunks()
# Chunks whose header does not decode cannot be tied to a request: counted only. Every other
# one, a wrong frame count included, names its request.
UNNAMED = {"garbage header", "empty header", "control message as header"}
NAMED = [name for name in BAD_CHUNKS if name not in UNNAMED]


def good_chunk(seed: int, request_id: str) -> tuple[list[object], torch.Tensor, torch.Tensor]:
    """A well-formed chunk built by hand, as the sender would frame it."""
    k, v = kv(seed)
    return [header_for(k, v, request_id=request_id), as_bytes(k), as_bytes(v)], k, v


@pytest.fixture
def raw_push(context: zmq.Context, receiver: KVReceiver) -> Iterator[zmq.Socket]:
    socket = context.socket(zmq.PUSH)
    socket.connect(receiver.address)
    yield socket
    socket.close(linger=0)


@pytest.mark.parametrize("name", list(BAD_CHUNKS))
def test_a_bad_chunk_is_dropped_and_counted(
    receiver: KVReceiver, raw_push: zmq.Socket, name: str
) -> None:
    raw_push.send_multipart(BAD_CHUNKS[name])
    frames, k, v = good_chunk(9, "good")
    raw_push.send_multipart(frames)  # same pipe: arrives after the bad one
    (payload,) = receive(receiver, 1)
    assert payload.header.request_id == "good"
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert receiver.rejected == 1
    rejections = receiver.take_rejections()
    if name in UNNAMED:
        assert rejections == []
    else:
        assert [(r.request_id, r.epoch) for r in rejections] == [(BAD_ID, BAD_EPOCH)]
        assert isinstance(rejections[0], KVRejected) and rejections[0].reason
    assert receiver.take_rejections() == []  # taken once


def test_rejections_say_why(receiver: KVReceiver, raw_push: zmq.Socket) -> None:
    expected = {
        "bad checksum": "checksum", "unknown dtype": "dtype",
        "too few frames": "2 frames, not 3", "too many frames": "4 frames, not 3",
        "one frame": "1 frames, not 3",
        "shape too small": "match the header", "negative shape": "match the header",
        "negative inner dims": "match the header",
        "tokens not as the header says": "match the header",
        "inner dims do not fit": "fit the buffers", "buffer not a whole element": "fit",
    }
    for name in expected:
        raw_push.send_multipart(BAD_CHUNKS[name])
    raw_push.send_multipart(good_chunk(0, "good")[0])
    receive(receiver, 1)
    reasons = [r.reason for r in receiver.take_rejections()]
    assert len(reasons) == len(expected)
    for reason, (name, fragment) in zip(reasons, expected.items(), strict=True):
        assert fragment in reason, (name, reason)


@pytest.mark.parametrize("count", [1, 2, 4, 5])
def test_a_wrong_frame_count_is_rejected_for_its_request(
    receiver: KVReceiver, raw_push: zmq.Socket, count: int
) -> None:
    """The header decodes, so the request it names hears why: even when its first three frames
    are a valid chunk."""
    frames, _, _ = good_chunk(11, BAD_ID)
    frames[0] = header_for(*kv(11), request_id=BAD_ID, epoch=BAD_EPOCH)
    raw_push.send_multipart((frames * 2)[:count])
    raw_push.send_multipart([b"not a header", b"k"])  # no header: counted, nobody to tell
    raw_push.send_multipart(good_chunk(12, "good")[0])
    assert [p.header.request_id for p in receive(receiver, 1)] == ["good"]
    assert receiver.rejected == 2
    assert receiver.take_rejections() == [
        KVRejected(BAD_ID, BAD_EPOCH, f"{count} frames, not 3")]


def test_every_bad_chunk_is_counted_and_good_ones_still_arrive(
    receiver: KVReceiver, sender: KVSender, raw_push: zmq.Socket
) -> None:
    for i, frames in enumerate(BAD_CHUNKS.values()):
        raw_push.send_multipart(frames)
        raw_push.send_multipart(good_chunk(i, f"by-hand-{i}")[0])
    got = receive(receiver, len(BAD_CHUNKS))
    assert [p.header.request_id for p in got] == [f"by-hand-{i}" for i in range(len(got))]
    assert receiver.rejected == len(BAD_CHUNKS)
    rejections = receiver.take_rejections()
    assert [(r.request_id, r.epoch) for r in rejections] == [(BAD_ID, BAD_EPOCH)] * len(NAMED)
    k, v = kv(10)
    sender.send(receiver.address, "from-sender", 0, b"m", k, v)
    (payload,) = receive(receiver, 1)
    assert payload.header.meta == b"m" and torch.equal(payload.k, k)
    assert receive_nothing_more(receiver) == [] and receiver.rejected == len(BAD_CHUNKS)
    assert receiver.take_rejections() == []


def test_sender_keeps_one_socket_per_address(
    context: zmq.Context, receiver: KVReceiver, sender: KVSender
) -> None:
    other = make_receiver(context, "tcp://127.0.0.1:*")
    k, v = kv(11)
    for address in (receiver.address, other.address, receiver.address):
        sender.send(address, "r", 0, b"", k, v)
    assert len(receive(receiver, 2)) == 2 and len(receive(other, 1)) == 1
    assert len(sender.sockets) == 2  # type: ignore[attr-defined]
    other.close()


@pytest.fixture
def dead_tcp_address() -> Iterator[str]:
    """A tcp address where nothing listens: the port is held (bound, never listening), so no
    other test or process can take it meanwhile, and connections to it are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{held.getsockname()[1]}"


def test_sending_where_nothing_listens_raises_soon(
    context: zmq.Context, sender: KVSender, tmp_path: Path, dead_tcp_address: str
) -> None:
    k, v = kv(12)
    for address in (dead_tcp_address, f"ipc://{tmp_path}/nobody"):
        started = time.monotonic()
        with pytest.raises(TransferError):
            sender.send(address, "r", 0, b"", k, v)
        assert time.monotonic() - started < 3.0
        assert sender.bytes_sent == 0  # type: ignore[attr-defined]
    live = make_receiver(context, "tcp://127.0.0.1:*")
    try:
        sender.send(live.address, "kept", 0, b"", k, v)  # the failures left the sender usable
        assert [p.header.request_id for p in receive(live, 1)] == ["kept"]
    finally:
        live.close()


def test_a_dead_receiver_does_not_take_the_chunk(
    context: zmq.Context, sender: KVSender, receiver: KVReceiver
) -> None:
    """Nothing queues for a receiver that went away; the next one at its address gets only
    what was sent to it."""
    k, v = kv(13)
    sender.send(receiver.address, "before", 0, b"", k, v)
    assert [p.header.request_id for p in receive(receiver, 1)] == ["before"]
    address = receiver.address
    receiver.close()
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(TransferError):  # once the sender notices the peer is gone
        while time.monotonic() < deadline:
            sender.send(address, "lost", 0, b"", k, v)
    if address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
    again = make_receiver(context, address)
    try:
        sender.send(address, "after", 0, b"", k, v)
        got = receive(again, 1) + receive_nothing_more(again)
        assert [p.header.request_id for p in got] == ["after"]
    finally:
        again.close()

