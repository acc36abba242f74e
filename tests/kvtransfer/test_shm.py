"""KV through shared memory: chunks staged in the sender's /dev/shm segment, read in place as
borrowed views, verified, and released so a small buffer serves any number of chunks; what
does not fit goes inline; corrupt or misplaced chunks are rejected; dead owners' segments are
swept.

Run as a script, this file is the other process of the two-process tests:
`test_shm.py receive BIND COUNT` (a receiver) or `test_shm.py hold` (a sender that waits).
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from core.config import KVTransferConfig
from kvtransfer import KVReceiver, KVRejected, make_receiver, make_sender
from kvtransfer.shm import SHM_DIR, ShmKVSender, sweep_dead_segments
from kvtransfer.wire import FORWARD_CODEC, KVItem, KVPayload, Placement, as_bytes, checksum
from tests.kvtransfer.conftest import (
    DTYPES,
    WAIT_S,
    header_for,
    is_payload_of,
    kv,
    payloads,
    receive,
)

ROOT = Path(__file__).resolve().parents[2]
START_S = 30.0  # for a new Python process to import torch and say it is ready
BUFFER = 2**20
TWO_FIT = (1, 100, 8, 64)  # float32: K and V take 400 KiB, so two chunks fit in BUFFER
COUNT = 48  # chunks in the two-process round trip: 4 MiB through a 1 MiB buffer


def two_process_chunk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At most 128 KiB of K and V, every dtype in turn."""
    return kv(seed, DTYPES[seed % 3], (1, 64, 4, 64))


@pytest.fixture
def shm_sender(context: zmq.Context) -> Iterator[ShmKVSender]:
    sender = make_sender(context, KVTransferConfig(backend="shm", buffer_mb=1))
    assert isinstance(sender, ShmKVSender)
    yield sender
    sender.close()


def flush_releases(sender: ShmKVSender) -> None:
    """Wait for the releases the receiver sent after its drain, and take them."""
    deadline = time.monotonic() + WAIT_S
    while sender.ring.in_use:
        assert time.monotonic() < deadline, f"{sender.ring.in_use} regions never released"
        for socket in sender.sockets.values():
            socket.poll(50, zmq.POLLIN)
        sender._take_releases()


def drain_borrowed(receiver: KVReceiver, count: int) -> list[KVItem]:
    """Like `receive`, but keeping what the drain hands as it is (no copy)."""
    got: list[KVItem] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} items arrived"
        receiver.fileno_socket().poll(50)
        receiver.drain(got.append)
    return got


# --- in one process --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact_and_placed(
    receiver: KVReceiver, shm_sender: ShmKVSender, dtype: torch.dtype,
) -> None:
    k, v = kv(0, dtype, (2, 7, 3, 5))  # odd sizes: regions are still aligned
    shm_sender.send_layers(receiver.address, "r1", 3, 4, k, v, token_start=512)
    (payload,) = payloads(receive(receiver, 1))
    assert payload.borrowed and payload.key == ("r1", 3)
    placement = payload.header.placement
    assert placement is not None and placement.kind == "shm"
    assert placement.segment == shm_sender.segment and placement.handle == b""
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert (payload.header.layer_start, payload.header.layer_end) == (4, 6)
    assert payload.header.token_start == 512
    assert shm_sender.counters.chunks == receiver.counters.chunks == 1
    assert shm_sender.counters.bytes == receiver.counters.bytes == k.nbytes + v.nbytes


def test_a_payload_views_the_senders_segment_until_released(
    receiver: KVReceiver, shm_sender: ShmKVSender,
) -> None:
    """Borrowed means zero-copy: what the sender writes to the region later shows through,
    which is why a worker copies a payload during the drain."""
    k, v = kv(1)
    shm_sender.send_layers(receiver.address, "r", 0, 0, k, v)
    (payload,) = payloads(drain_borrowed(receiver, 1))
    assert payload.borrowed and torch.equal(payload.k, k)
    offset = payload.header.placement.offset  # type: ignore[union-attr]
    shm_sender.buffer.array[offset:offset + k.nbytes] = 0  # as a reuse of the region would
    assert torch.equal(payload.k, torch.zeros_like(k)) and torch.equal(payload.v, v)


def test_released_regions_are_reused_with_no_inline_fallback(
    receiver: KVReceiver, shm_sender: ShmKVSender,
) -> None:
    k, v = kv(2, torch.float32, TWO_FIT)
    offsets: set[int] = set()
    for i in range(20):  # 8 MB through a 1 MB buffer
        shm_sender.send_layers(receiver.address, f"r{i}", 0, 0, k, v)
        (payload,) = payloads(receive(receiver, 1))
        assert payload.borrowed and payload.header.request_id == f"r{i}"
        assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
        offsets.add(payload.header.placement.offset)  # type: ignore[union-attr]
        flush_releases(shm_sender)
    assert shm_sender.inline_fallbacks == 0 and shm_sender.ring.expired == 0
    assert len(offsets) <= 3 and receiver.rejected == 0


def test_a_chunk_larger_than_the_buffer_goes_inline_at_once(
    receiver: KVReceiver, shm_sender: ShmKVSender,
) -> None:
    k, v = kv(3, torch.float32, (2, 300, 8, 64))  # 1.2 MB each
    started = time.monotonic()
    shm_sender.send_layers(receiver.address, "big", 0, 0, k, v)
    assert time.monotonic() - started < 0.5  # no wait for room that can never be
    (payload,) = payloads(receive(receiver, 1))
    assert payload.header.placement is None and not payload.borrowed
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert shm_sender.inline_fallbacks == 1 and shm_sender.ring.in_use == 0


def test_a_receiver_on_another_host_gets_its_chunks_inline_counted_as_zmq(
    receiver: KVReceiver, shm_sender: ShmKVSender,
) -> None:
    k, v = kv(4)
    shm_sender.send_layers(receiver.address, "far", 0, 0, k, v, stage=False)
    shm_sender.send_layers(receiver.address, "near", 0, 0, k, v)
    far, near = payloads(receive(receiver, 2))
    assert far.header.placement is None and not far.borrowed
    assert torch.equal(far.k, k) and torch.equal(far.v, v)
    assert near.header.placement is not None and near.borrowed
    assert shm_sender.inline_fallbacks == 0  # asked for, not a fallback
    totals = {backend: counters.chunks for backend, counters in shm_sender.totals()}
    assert totals == {"shm": 1, "zmq": 1}


def test_a_full_buffer_goes_inline_after_a_moment_instead_of_blocking(
    receiver: KVReceiver, shm_sender: ShmKVSender,
) -> None:
    sent = [kv(seed, torch.float32, TWO_FIT) for seed in range(3)]
    for i, (k, v) in enumerate(sent[:2]):
        shm_sender.send_layers(receiver.address, f"r{i}", 0, 0, k, v)
    started = time.monotonic()
    shm_sender.send_layers(receiver.address, "r2", 0, 0, *sent[2])  # nobody drains meanwhile
    waited = time.monotonic() - started
    assert 0.04 <= waited < 1.0, waited
    assert shm_sender.inline_fallbacks == 1 and shm_sender.ring.in_use == 2
    got = payloads(receive(receiver, 3))
    assert [p.header.request_id for p in got] == ["r0", "r1", "r2"]
    assert [p.borrowed for p in got] == [True, True, False]
    for payload, (k, v) in zip(got, sent, strict=True):
        assert torch.equal(payload.k, k) and torch.equal(payload.v, v)


def test_a_corrupted_region_is_rejected_never_delivered_and_released(
    receiver: KVReceiver, shm_sender: ShmKVSender,
) -> None:
    k, v = kv(4)
    shm_sender.send_layers(receiver.address, "bad", 2, 0, k, v)
    (region,) = shm_sender.ring.live
    shm_sender.buffer.array[region.offset + k.nbytes + 5] ^= 0x10  # one bit of V, after sending
    (item,) = receive(receiver, 1)
    assert isinstance(item, KVRejected) and item.key == ("bad", 2)
    assert "checksum" in item.reason
    assert receiver.dropped == Counter({"checksum": 1}) and receiver.counters.chunks == 0
    flush_releases(shm_sender)  # its region came back all the same
    shm_sender.send_layers(receiver.address, "good", 0, 0, k, v)
    (payload,) = payloads(receive(receiver, 1))
    assert payload.borrowed and torch.equal(payload.k, k) and torch.equal(payload.v, v)


def test_a_reclaimed_region_read_late_is_rejected_not_misread(
    context: zmq.Context, receiver: KVReceiver,
) -> None:
    """A receiver that stalls past the lease: the region is reused, and the stale header no
    longer matches what lies there."""
    sender = ShmKVSender(context, BUFFER, lease_s=0.1)
    try:
        old, new = kv(5, torch.float32, (1, 200, 8, 64)), kv(6, torch.float32, (1, 200, 8, 64))
        sender.send_layers(receiver.address, "old", 0, 0, *old)  # 800 KiB: one fits
        time.sleep(0.15)
        sender.send_layers(receiver.address, "new", 0, 0, *new)  # reclaims and overwrites
        assert sender.ring.expired == 1 and sender.inline_fallbacks == 0
        stale, fresh = receive(receiver, 2)
        assert isinstance(stale, KVRejected) and stale.request_id == "old"
        assert isinstance(fresh, KVPayload) and torch.equal(fresh.k, new[0])
        flush_releases(sender)  # the stale ticket's release frees nothing; the new one's does
    finally:
        sender.close()


def test_a_chunk_never_released_leaves_the_staged_count_when_its_lease_runs_out(
    context: zmq.Context, receiver: KVReceiver,
) -> None:
    """Its receiver died: with nothing new to send, the heartbeat's count still drops."""
    sender = ShmKVSender(context, BUFFER, lease_s=0.1)
    try:
        sender.send_layers(receiver.address, "orphan", 0, 0, *kv(7, torch.float32, TWO_FIT))
        assert sender.staged == 1 and sender.leases_expired == 0
        time.sleep(0.15)
        assert sender.staged == 0 and sender.leases_expired == 1
    finally:
        sender.close()


BAD_SEGMENTS = ["../etc/passwd", "raging-kv-1-zz", "/dev/shm/raging-kv-1-0123456789ab",
                "raging-kv-1-0123456789ab/../../etc/passwd", "", "raging-kv-1-0123456789ab"]


@pytest.mark.parametrize("segment", BAD_SEGMENTS)
def test_a_bad_segment_name_is_rejected_as_placement(
    receiver: KVReceiver, dealer: zmq.Socket, segment: str,
) -> None:
    """Names that are not a KV segment's are never opened; a well-formed name that does not
    exist (the last) cannot be."""
    k, v = kv(7)
    header = header_for(k, v, placement=Placement("shm", segment, 0, 0, b""), request_id="x")
    dealer.send(FORWARD_CODEC.encode(header))
    dealer.send_multipart([FORWARD_CODEC.encode(header_for(k, v, request_id="good")),
                           as_bytes(k), as_bytes(v)])
    *rejected, good = receive(receiver, 1, until=is_payload_of("good"))
    assert [(r.key, type(r)) for r in rejected] == [(("x", 0), KVRejected)]
    assert receiver.dropped == Counter({"placement": 1})
    assert torch.equal(good.k, k)  # type: ignore[union-attr]


@pytest.mark.parametrize("offset", [BUFFER - 64, BUFFER, -64, 2**40])
def test_an_offset_outside_the_segment_is_rejected_as_placement(
    receiver: KVReceiver, dealer: zmq.Socket, shm_sender: ShmKVSender, offset: int,
) -> None:
    k, v = kv(8)  # 960 bytes each
    placement = Placement("shm", shm_sender.segment, offset, 0, b"")
    dealer.send(FORWARD_CODEC.encode(header_for(k, v, placement=placement)))
    (item,) = receive(receiver, 1)
    assert isinstance(item, KVRejected) and "outside" in item.reason
    assert receiver.dropped == Counter({"placement": 1})


def test_the_segment_is_private_and_removed_on_close(context: zmq.Context) -> None:
    sender = make_sender(context, KVTransferConfig(backend="shm", buffer_mb=1))
    assert isinstance(sender, ShmKVSender) and sender.backend == "shm"
    path = SHM_DIR / sender.segment
    try:
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
        assert info.st_size == BUFFER == sender.ring.capacity
        assert sender.segment.startswith(f"raging-kv-{os.getpid()}-")
    finally:
        sender.close()
    assert not path.exists()


def test_an_empty_segment_file_is_rejected_as_placement(
    receiver: KVReceiver, dealer: zmq.Socket,
) -> None:
    path = SHM_DIR / f"raging-kv-{os.getpid()}-0123456789ab"
    path.touch(mode=0o600, exist_ok=False)
    try:
        k, v = kv(9)
        placement = Placement("shm", path.name, 0, 0, b"")
        dealer.send(FORWARD_CODEC.encode(header_for(k, v, placement=placement)))
        (item,) = receive(receiver, 1)
        assert isinstance(item, KVRejected) and receiver.dropped == Counter({"placement": 1})
    finally:
        path.unlink()


def test_a_chunk_of_no_bytes_does_not_break_the_drain(
    receiver: KVReceiver, dealer: zmq.Socket, shm_sender: ShmKVSender,
) -> None:
    k, v = kv(10, shape=(2, 5, 0, 8))
    placement = Placement("shm", shm_sender.segment, 0, 0, b"")
    header = header_for(k, v, placement=placement, checksum=checksum(memoryview(b"")))
    dealer.send(FORWARD_CODEC.encode(header))
    (item,) = receive(receiver, 1)
    assert isinstance(item, KVRejected) and "no element" in item.reason


# --- two processes ---------------------------------------------------------------------------


def start(*args: str) -> subprocess.Popen[bytes]:
    """This file as a script, in a new process; its stderr is the test's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT, env=env, bufsize=0,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=WAIT_S)


def read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The process's next line of output, or a failure once `timeout` passes."""
    assert process.stdout is not None
    fd, line = process.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no line from process {process.pid} in {timeout} s: {line!r}"
        if select.select([fd], [], [], remaining)[0]:
            byte = os.read(fd, 1)  # one at a time: never past the line
            assert byte, f"process {process.pid} ended ({process.poll()}) after {line!r}"
            line += byte
    return line.decode().strip()


def test_round_trip_to_a_receiver_in_another_process(context: zmq.Context) -> None:
    process = start("receive", "tcp://127.0.0.1:*", str(COUNT))
    sender = ShmKVSender(context, BUFFER, lease_s=30.0)
    try:
        address = read_line(process, START_S)
        for seed in range(COUNT):
            sender.send_layers(address, str(seed), 0, 0, *two_process_chunk(seed))
        report = json.loads(read_line(process, WAIT_S))
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        stop(process)
        sender.close()
    assert report == {"received": list(range(COUNT)), "exact": COUNT, "borrowed": COUNT,
                      "segments": [sender.segment], "dropped": {}}
    assert sender.inline_fallbacks == 0  # its 1 MiB was reused, as the receiver released it
    assert sender.counters.bytes >= 4 * BUFFER


def test_sweep_removes_a_killed_owners_segment_and_leaves_live_ones(
    context: zmq.Context,
) -> None:
    own = ShmKVSender(context, 2**16, lease_s=30.0)
    process = start("hold")
    try:
        path = SHM_DIR / read_line(process, START_S)
        assert path.name.startswith(f"raging-kv-{process.pid}-") and path.exists()
        sweep_dead_segments()
        assert path.exists() and own.buffer.path.exists()  # both owners are alive
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=WAIT_S)
        assert path.exists()  # a SIGKILL leaves the segment behind...
        sweep_dead_segments()
        assert not path.exists()  # ...until the next sweep
        assert own.buffer.path.exists()
    finally:
        stop(process)
        sweep_dead_segments()  # its segment, had the test stopped before the sweep
        own.close()


def _receive_in_this_process(bind: str, count: int) -> None:
    """Receive `count` chunks, checking each while it is borrowed; report as one JSON line."""
    expected = {str(seed): two_process_chunk(seed) for seed in range(count)}
    context = zmq.Context()
    receiver = make_receiver(context, bind)
    print(receiver.address, flush=True)
    received: list[int] = []
    exact = borrowed = 0
    segments: set[str] = set()

    def handle(item: KVItem) -> None:
        nonlocal exact, borrowed
        assert isinstance(item, KVPayload), item
        k, v = expected[item.header.request_id]
        received.append(int(item.header.request_id))
        exact += torch.equal(item.k, k) and torch.equal(item.v, v)
        borrowed += item.borrowed
        if item.header.placement is not None:
            segments.add(item.header.placement.segment)

    deadline = time.monotonic() + START_S
    while len(received) < count and time.monotonic() < deadline:
        receiver.fileno_socket().poll(100)
        receiver.drain(handle)
    time.sleep(0.1)  # the last releases out before the socket closes
    print(json.dumps({"received": received, "exact": exact, "borrowed": borrowed,
                      "segments": sorted(segments), "dropped": dict(receiver.dropped)}),
          flush=True)
    receiver.close()
    context.destroy(linger=0)


def _hold_a_segment() -> None:
    """Create a sender, say its segment's name, and wait (to be killed)."""
    sender = ShmKVSender(zmq.Context(), 2**16, lease_s=30.0)
    print(sender.segment, flush=True)
    sys.stdin.readline()
    sender.close()


if __name__ == "__main__":
    if sys.argv[1] == "receive":
        _receive_in_this_process(sys.argv[2], int(sys.argv[3]))
    else:
        _hold_a_segment()
