"""KVReceiver (ROUTER, tcp and ipc) against a raw DEALER peer: every bad message is dropped and
counted by kind, never raised; one that names its request comes back as a KVRejected that says
why; and the good chunk after it still arrives."""

from __future__ import annotations

import contextlib
import pickle
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from core.config import KVBackend, KVTransferConfig
from core.curve import CurveKeys, generate, load
from core.messages import Abort, encode
from kvtransfer import (
    KVNotice,
    KVReceiver,
    KVRejected,
    KVSender,
    TransferError,
    make_receiver,
    make_sender,
)
from kvtransfer.wire import (
    FORWARD_CODEC,
    RELEASE_CODEC,
    KVItem,
    KVPayload,
    KVRelease,
    Placement,
    as_bytes,
    checksum,
)
from tests.kvtransfer.conftest import (
    header_for,
    is_payload_of,
    kv,
    payloads,
    receive,
    receive_nothing_more,
)

BAD_ID, BAD_EPOCH = "bad", 5


@dataclass(frozen=True)
class Bad:
    frames: list[bytes]
    kind: str  # the key of `receiver.dropped` it counts under
    reason: str | None  # a fragment of its KVRejected's reason; None: it names no request


def _bad_messages() -> dict[str, Bad]:
    k, v = kv(7)
    kb, vb = bytes(as_bytes(k)), bytes(as_bytes(v))
    small_k, small_v = kv(8, shape=(1, 1, 1, 3))
    small = [bytes(as_bytes(small_k)), bytes(as_bytes(small_v))]
    corrupted = bytearray(vb)
    corrupted[10] ^= 0x01

    def bad(k: torch.Tensor, v: torch.Tensor, **changes: Any) -> bytes:
        """A header that decodes and names its request."""
        return FORWARD_CODEC.encode(header_for(k, v, request_id=BAD_ID, epoch=BAD_EPOCH,
                                               **changes))

    def summed(*buffers: bytes) -> int:
        return checksum(*(memoryview(buffer) for buffer in buffers))

    mistyped = msgpack.packb([0, BAD_ID, "five", 0, 2, 5, "float32", [2, 5, 3, 8], 0, None])
    notice = FORWARD_CODEC.encode(KVNotice(BAD_ID, BAD_EPOCH, b"meta"))
    elsewhere = Placement("rdma", "segment", 0, 0, b"")
    placed = Placement("shm", "raging-kv-1-0123456789ab", 0, 0, b"")
    not_fit = "does not fit the buffers"
    not_match = "does not match the header"
    return {
        # the header does not decode: nobody to tell
        "garbage header": Bad([b"not a header", kb, vb], "malformed", None),
        "empty header": Bad([b"", kb, vb], "malformed", None),
        "mistyped header": Bad([mistyped, kb, vb], "malformed", None),
        "control message as header": Bad([encode(Abort("r", 0)), kb, vb], "malformed", None),
        "release sent forward": Bad([RELEASE_CODEC.encode(KVRelease("s", 1))], "malformed", None),
        "notice with data frames": Bad([notice, kb], "frames", None),
        # the data is not what the header says
        "bad checksum": Bad([bad(k, v, checksum=summed(kb, vb) ^ 1), kb, vb], "checksum",
                            "checksum mismatch"),
        "corrupted buffer": Bad([bad(k, v), kb, bytes(corrupted)], "checksum", "checksum"),
        "too few frames": Bad([bad(k, v), kb], "frames", "1 data frames, not 2"),
        "too many frames": Bad([bad(k, v), kb, vb, vb], "frames", "3 data frames, not 2"),
        "header only": Bad([bad(k, v)], "frames", "0 data frames, not 2"),
        "unknown dtype": Bad([bad(k, v, dtype="int8"), kb, vb], "header", "unknown dtype 'int8'"),
        "shape too big": Bad([bad(small_k, small_v, shape=[1, 1, 2, 2]), *small], "header",
                             not_fit),
        "shape too small": Bad([bad(k, v, shape=[1, 5, 3, 8]), kb, vb], "header", not_match),
        "layers not as the header says": Bad([bad(k, v, layer_start=3, layer_end=4), kb, vb],
                                             "header", not_match),
        "layers backwards": Bad([bad(k, v, layer_start=4, layer_end=2), kb, vb], "header",
                                not_match),
        "tokens not as the header says": Bad([bad(k, v, num_tokens=4), kb, vb], "header",
                                             not_match),
        "negative token start": Bad([bad(k, v, token_start=-1), kb, vb], "header",
                                    "negative token start"),
        "three dimensions": Bad([bad(k, v, shape=[2, 5, 24]), kb, vb], "header", not_match),
        "negative shape": Bad([bad(k, v, shape=[-2, 5, 3, 8]), kb, vb], "header", not_match),
        "negative inner dims": Bad([bad(k, v, shape=[2, 5, -3, -8]), kb, vb], "header",
                                   not_match),  # the right element count
        "inner dims do not fit": Bad([bad(k, v, shape=[2, 5, 3, 9]), kb, vb], "header", not_fit),
        "inner dims too small": Bad([bad(k, v, shape=[2, 5, 3, 4]), kb, vb], "header", not_fit),
        "v shorter than k": Bad([bad(k, v, checksum=summed(kb, vb[:-4])), kb, vb[:-4]], "header",
                                not_fit),
        "buffer not a whole element": Bad([bad(k, v, checksum=summed(b"abc", b"abc")), b"abc",
                                           b"abc"], "header", not_fit),
        "empty buffers": Bad([bad(k, v, checksum=summed(b"", b"")), b"", b""], "header", not_fit),
        # placed elsewhere, but not readable here
        "placement kind unknown": Bad([bad(k, v, placement=elsewhere)], "placement",
                                      "no reader for 'rdma'"),
        "placed chunk with data frames": Bad([bad(k, v, placement=placed), kb, vb], "frames",
                                             "2 data frames with a placed chunk"),
    }


BAD = _bad_messages()
NAMED = [name for name, bad in BAD.items() if bad.reason is not None]


def good_chunk(seed: int, request_id: str) -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
    """A well-formed inline chunk built by hand, framed as a sender frames it."""
    k, v = kv(seed)
    header = FORWARD_CODEC.encode(header_for(k, v, request_id=request_id))
    return [header, bytes(as_bytes(k)), bytes(as_bytes(v))], k, v


def rejections(items: list[KVItem]) -> list[KVRejected]:
    return [item for item in items if isinstance(item, KVRejected)]


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_message_is_dropped_counted_and_does_not_stop_the_next(
    receiver: KVReceiver, dealer: zmq.Socket, name: str,
) -> None:
    bad = BAD[name]
    dealer.send_multipart(bad.frames)
    frames, k, v = good_chunk(9, "good")
    dealer.send_multipart(frames)  # same pipe: arrives after the bad one
    got = receive(receiver, 1, until=is_payload_of("good"))
    *before, payload = got
    assert isinstance(payload, KVPayload)
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert receiver.dropped == Counter({bad.kind: 1}) and receiver.rejected == 1
    if bad.reason is None:
        assert before == []
    else:
        (rejected,) = before
        assert isinstance(rejected, KVRejected)
        assert rejected.key == (BAD_ID, BAD_EPOCH) and bad.reason in rejected.reason
    assert receiver.counters.chunks == 1  # only the good one


def test_every_bad_message_in_a_row_is_counted_and_good_ones_still_arrive(
    receiver: KVReceiver, sender: KVSender, dealer: zmq.Socket,
) -> None:
    for i, bad in enumerate(BAD.values()):
        dealer.send_multipart(bad.frames)
        dealer.send_multipart(good_chunk(i, f"by-hand-{i}")[0])
    last = f"by-hand-{len(BAD) - 1}"
    got = receive(receiver, 1, until=is_payload_of(last))
    chunks = [item for item in got if isinstance(item, KVPayload)]
    assert [p.header.request_id for p in chunks] == [f"by-hand-{i}" for i in range(len(BAD))]
    assert receiver.dropped == Counter(bad.kind for bad in BAD.values())
    assert receiver.rejected == len(BAD)
    reasons = [r.reason for r in rejections(got)]
    assert len(reasons) == len(NAMED)
    for reason, name in zip(reasons, NAMED, strict=True):  # in the order sent
        fragment = BAD[name].reason
        assert fragment is not None and fragment in reason, (name, reason)
    assert all(r.key == (BAD_ID, BAD_EPOCH) for r in rejections(got))
    k, v = kv(10)
    sender.send_layers(receiver.address, "from-sender", 0, 0, k, v)
    (payload,) = payloads(receive(receiver, 1))
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert receive_nothing_more(receiver) == [] and receiver.rejected == len(BAD)


@pytest.mark.parametrize("count", [1, 2, 4, 5])
def test_a_wrong_frame_count_is_rejected_for_its_request(
    receiver: KVReceiver, dealer: zmq.Socket, count: int,
) -> None:
    """The header decodes, so the request it names hears why: even when its first three frames
    are a valid chunk."""
    frames, _, _ = good_chunk(11, BAD_ID)
    frames[0] = FORWARD_CODEC.encode(header_for(*kv(11), request_id=BAD_ID, epoch=BAD_EPOCH))
    dealer.send_multipart((frames * 2)[:count])
    dealer.send_multipart([b"not a header", b"k"])  # no header: counted, nobody to tell
    dealer.send_multipart(good_chunk(12, "good")[0])
    got = receive(receiver, 1, until=is_payload_of("good"))
    assert got[:-1] == [KVRejected(BAD_ID, BAD_EPOCH, f"{count - 1} data frames, not 2")]
    assert receiver.dropped == Counter({"frames": 1, "malformed": 1})


def test_notices_and_chunks_from_a_peer_arrive_in_its_order(
    receiver: KVReceiver, dealer: zmq.Socket,
) -> None:
    sent: list[tuple[str, int]] = []
    for i in range(10):
        if i % 3 == 0:
            dealer.send(FORWARD_CODEC.encode(KVNotice(f"n{i}", i, bytes([i]))))
        else:
            dealer.send_multipart(good_chunk(i, f"c{i}")[0])
        sent.append((f"{'n' if i % 3 == 0 else 'c'}{i}", i))
    got = receive(receiver, len(sent))
    assert [(item.key[0], int(item.key[0][1:])) for item in got] == sent
    for item in got:
        if isinstance(item, KVNotice):
            assert item.meta == bytes([item.epoch])
        else:
            assert isinstance(item, KVPayload)
            assert torch.equal(item.k, kv(int(item.header.request_id[1:]))[0])


def test_drain_hands_the_count_and_returns_at_once_when_nothing_waits(
    receiver: KVReceiver, dealer: zmq.Socket,
) -> None:
    started = time.monotonic()
    assert receiver.drain(lambda item: pytest.fail(f"handed {item}")) == 0
    assert time.monotonic() - started < 0.05
    dealer.send_multipart(good_chunk(1, "a")[0])
    dealer.send_multipart(BAD["too few frames"].frames)
    dealer.send_multipart(BAD["garbage header"].frames)  # dropped, not handed
    dealer.send(FORWARD_CODEC.encode(KVNotice("a", 0, b"")))
    handed: list[KVItem] = []
    deadline = time.monotonic() + 5.0
    while len(handed) < 3 and time.monotonic() < deadline:
        receiver.fileno_socket().poll(100)
        before = len(handed)
        assert receiver.drain(handed.append) == len(handed) - before  # what it handed
    assert [type(item) for item in handed] == [KVPayload, KVRejected, KVNotice]


def test_inline_chunks_are_not_released(receiver: KVReceiver, dealer: zmq.Socket) -> None:
    """Only placed chunks go back to their sender; inline ones and notices owe nothing."""
    dealer.send_multipart(good_chunk(1, "a")[0])
    dealer.send(FORWARD_CODEC.encode(KVNotice("a", 0, b"")))
    receive(receiver, 2)
    assert not dealer.poll(100, zmq.POLLIN)


# --- CURVE -----------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    generate(tmp_path / "keys")
    return load(tmp_path / "keys")


@pytest.fixture
def curve_receiver(context: zmq.Context, bind: str, keys: CurveKeys) -> Iterator[KVReceiver]:
    receiver = make_receiver(context, bind, keys)
    yield receiver
    receiver.close()


def wait_for_rejections(receiver: KVReceiver, count: int) -> None:
    deadline = time.monotonic() + 5.0
    while receiver.rejected_peers < count:
        assert time.monotonic() < deadline, f"{receiver.rejected_peers} rejected"
        time.sleep(0.02)


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_with_curve_the_clusters_senders_get_through(
    curve_receiver: KVReceiver, context: zmq.Context, keys: CurveKeys, backend: KVBackend,
) -> None:
    sender = make_sender(context, KVTransferConfig(backend=backend, buffer_mb=1), keys)
    try:
        k, v = kv(3)
        sender.send_layers(curve_receiver.address, "a", 0, 0, k, v)
        sender.notify(curve_receiver.address, "a", 0, b"meta")
        payload, notice = receive(curve_receiver, 2)
        assert isinstance(payload, KVPayload) and torch.equal(payload.k, k)
        assert notice == KVNotice("a", 0, b"meta")
        deadline = time.monotonic() + 5.0
        while sender.staged:  # a placed chunk's release came back over CURVE
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert curve_receiver.rejected_peers == 0
    finally:
        sender.close()


def test_with_curve_peers_without_the_keys_get_nothing_through_and_are_counted(
    curve_receiver: KVReceiver, context: zmq.Context, keys: CurveKeys,
) -> None:
    plain = context.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(curve_receiver.address)
    # Not blocking: after a refused handshake a DEALER may have no pipe to queue on.
    for frames in (good_chunk(1, "from-plain")[0], [pickle.dumps(("not", "unpickled"))]):
        with contextlib.suppress(zmq.Again):
            plain.send_multipart(frames, flags=zmq.NOBLOCK)
    stranger_keys = CurveKeys(keys.server_public, b"", *zmq.curve_keypair(), frozenset())
    stranger = make_sender(context, keys=stranger_keys)
    with pytest.raises(TransferError, match="not reachable"):
        stranger.send_layers(curve_receiver.address, "from-stranger", 0, 0, *kv(2))
    wait_for_rejections(curve_receiver, 2)
    assert receive_nothing_more(curve_receiver) == []
    assert curve_receiver.dropped == Counter() and curve_receiver.counters.chunks == 0
    sender = make_sender(context, keys=keys)
    sender.send_layers(curve_receiver.address, "good", 0, 0, *kv(3))
    assert [p.header.request_id for p in payloads(receive(curve_receiver, 1))] == ["good"]
    for closing in (plain, stranger, sender):
        closing.close()
