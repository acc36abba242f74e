"""KV over CUDA IPC: exact round trips on one device, regions reused once released, bad chunks
dropped; and, on a host without CUDA, a sender that refuses to start and a reader that drops.

The GPU tests need CUDA and cupy and skip without them. Run as a script, this file is the
sending process of the two-process tests: `test_cuda_ipc.py ADDRESS COUNT ENDING`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from core.config import KVTransferConfig
from kvtransfer import KVReceiver, KVSender, make_receiver, make_sender
from kvtransfer.base import BadChunk
from kvtransfer.cuda_ipc import CudaIpcKVSender, CudaIpcReader, cuda_problem, device_checksum
from kvtransfer.wire import (
    FORWARD_CODEC,
    RELEASE_CODEC,
    KVHeader,
    KVItem,
    KVPayload,
    KVRejected,
    Placement,
    dtype_name,
)

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 10.0
CUDA_PROBLEM = cuda_problem()
needs_cuda = pytest.mark.skipif(CUDA_PROBLEM is not None,
                                reason=f"cuda_ipc needs a GPU and cupy: {CUDA_PROBLEM}")


def chunk(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk, the same in every process; odd sizes, all three dtypes."""
    dtype = (torch.float32, torch.float16, torch.bfloat16)[seed % 3]
    shape = (2, 5 + seed, 3, 7)
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=generator).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    return k.to(device), v.to(device)


def header_with(placement: Placement, k: torch.Tensor, checksum: int = 0) -> KVHeader:
    return KVHeader(request_id="r", epoch=0, layer_start=0, layer_end=k.shape[0],
                    num_tokens=k.shape[1], dtype=dtype_name(k.dtype), shape=list(k.shape),
                    checksum=checksum, placement=placement)


def receive(receiver: KVReceiver, count: int) -> list[KVItem]:
    """Poll and drain until `count` chunks (verified or rejected) arrived."""
    got: list[KVItem] = []
    deadline = time.monotonic() + WAIT_S
    while len([i for i in got if isinstance(i, KVPayload | KVRejected)]) < count:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        assert remaining_ms > 0, f"only {len(got)} of {count} chunks arrived"
        receiver.fileno_socket().poll(min(remaining_ms, 100))
        receiver.drain(got.append)  # our reader's tensors are copies, never borrowed views
    return got


def flush_releases(sender: KVSender) -> None:
    """Wait until the releases the receiver sent after its drains reach the sender."""
    for socket in sender.sockets.values():
        assert socket.poll(int(WAIT_S * 1000), zmq.POLLIN)


@pytest.fixture
def receiver(context: zmq.Context) -> Iterator[KVReceiver]:
    receiver = make_receiver(context, "tcp://127.0.0.1:*")
    receiver.readers.setdefault("cuda_ipc", CudaIpcReader())
    yield receiver
    receiver.close()


# --- without CUDA (here: forced off, so these run on every host) -------------------------------


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.usefixtures("no_cuda")
def test_the_sender_refuses_to_start_without_cuda(context: zmq.Context) -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        CudaIpcKVSender(context, 2**20, 30.0)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        make_sender(context, KVTransferConfig(backend="cuda_ipc", buffer_mb=1))


def _cuda_placement(ticket: int = 0) -> Placement:
    return Placement("cuda_ipc", "cuda-1-0123456789ab", 0, ticket, bytes(64))


@pytest.mark.usefixtures("no_cuda")
def test_the_reader_drops_placed_chunks_without_cuda() -> None:
    reader = CudaIpcReader()
    k, _ = chunk(0)
    with pytest.raises(BadChunk, match="CUDA is not available on this worker") as caught:
        reader.read(header_with(_cuda_placement(), k))
    assert caught.value.kind == "placement"
    reader.close()


@pytest.mark.usefixtures("no_cuda")
def test_a_receiver_without_cuda_drops_the_chunk_and_releases_it(
    context: zmq.Context, receiver: KVReceiver,
) -> None:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(receiver.address)
    try:
        k, _ = chunk(0)
        dealer.send(FORWARD_CODEC.encode(header_with(_cuda_placement(ticket=7), k)))
        (item,) = receive(receiver, 1)
        assert isinstance(item, KVRejected) and item.request_id == "r"
        assert receiver.dropped["placement"] == 1
        assert dealer.poll(int(WAIT_S * 1000), zmq.POLLIN)
        release = RELEASE_CODEC.decode(dealer.recv())
        assert (release.segment, release.ticket) == ("cuda-1-0123456789ab", 7)
    finally:
        dealer.close(linger=0)


# --- on a GPU ----------------------------------------------------------------------------------


def reference_checksum(data: bytes) -> int:
    """The device checksum, on the host: sum of splitmix64((i << 16) | word_i) mod 2**64."""
    words = np.frombuffer(data, dtype="<u2").astype(np.uint64)
    x = (np.arange(len(words), dtype=np.uint64) << np.uint64(16)) | words
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return int(x.sum(dtype=np.uint64))


def device_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


@pytest.fixture
def sender(context: zmq.Context) -> Iterator[CudaIpcKVSender]:
    sender = make_sender(context, KVTransferConfig(backend="cuda_ipc", buffer_mb=1))
    assert isinstance(sender, CudaIpcKVSender)
    yield sender
    sender.close()


@needs_cuda
def test_the_device_checksum_is_the_reference_and_splits_at_any_word() -> None:
    data = torch.randint(0, 256, (3 * 2**20 + 6,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    whole = device_checksum([(data.data_ptr(), data.numel())], stream, data.device.index)
    assert whole == reference_checksum(device_bytes(data))
    cut = 2 * 12345 + 2**20
    parts = [(data.data_ptr(), cut), (data.data_ptr() + cut, data.numel() - cut)]
    assert device_checksum(parts, stream, data.device.index) == whole
    flipped = data.clone()
    flipped[777] ^= 1
    assert device_checksum([(flipped.data_ptr(), flipped.numel())], stream, 0) != whole


@needs_cuda
@pytest.mark.parametrize("seed", [0, 1, 2, 3], ids=["float32", "float16", "bfloat16", "odd"])
def test_round_trip_in_one_process_is_exact(
    receiver: KVReceiver, sender: CudaIpcKVSender, seed: int,
) -> None:
    k, v = chunk(seed, "cuda")
    sender.send_layers(receiver.address, "r1", 3, 4, k, v, token_start=512)
    (payload,) = receive(receiver, 1)
    assert isinstance(payload, KVPayload)
    assert payload.header.placement is not None and payload.header.placement.kind == "cuda_ipc"
    assert payload.k.is_cuda and payload.v.is_cuda
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
    assert (payload.header.layer_start, payload.header.layer_end) == (4, 6)
    assert payload.header.token_start == 512


@needs_cuda
def test_released_regions_are_reused(receiver: KVReceiver, sender: CudaIpcKVSender) -> None:
    k, v = (t.to("cuda") for t in chunk(0))
    k, v = k.repeat(1, 300, 1, 1), v.repeat(1, 300, 1, 1)  # ~250 KB each: 2 fit in 1 MiB
    for i in range(12):
        sender.send_layers(receiver.address, f"r{i}", 0, 0, k, v)
        (payload,) = receive(receiver, 1)
        assert isinstance(payload, KVPayload) and payload.header.placement is not None
        assert torch.equal(payload.k, k) and torch.equal(payload.v, v)
        flush_releases(sender)
    assert sender.inline_fallbacks == 0 and sender.ring.in_use <= 1


@needs_cuda
def test_a_chunk_that_does_not_fit_goes_inline(
    receiver: KVReceiver, sender: CudaIpcKVSender,
) -> None:
    k = torch.randn(2, 300, 8, 64, device="cuda")  # 1.2 MB each: more than the whole buffer
    v = torch.randn(2, 300, 8, 64, device="cuda")
    sender.send_layers(receiver.address, "big", 0, 0, k, v)
    (payload,) = receive(receiver, 1)
    assert isinstance(payload, KVPayload) and payload.header.placement is None
    assert torch.equal(payload.k, k.cpu()) and torch.equal(payload.v, v.cpu())
    assert sender.inline_fallbacks == 1 and sender.ring.in_use == 0


@needs_cuda
def test_cpu_tensors_go_inline(receiver: KVReceiver, sender: CudaIpcKVSender) -> None:
    k, v = chunk(1)
    sender.send_layers(receiver.address, "cpu", 0, 0, k, v)
    (payload,) = receive(receiver, 1)
    assert isinstance(payload, KVPayload) and payload.header.placement is None
    assert torch.equal(payload.k, k) and torch.equal(payload.v, v)


@needs_cuda
def test_a_bad_checksum_is_rejected_and_the_region_released(
    receiver: KVReceiver, sender: CudaIpcKVSender, monkeypatch: pytest.MonkeyPatch,
) -> None:
    stage = sender._stage
    monkeypatch.setattr(sender, "_stage", lambda *args: stage(*args) ^ 1)
    sender.send_layers(receiver.address, "bad", 2, 0, *chunk(2, "cuda"))
    (item,) = receive(receiver, 1)
    assert isinstance(item, KVRejected) and (item.request_id, item.epoch) == ("bad", 2)
    assert "checksum" in item.reason and receiver.dropped["checksum"] == 1
    monkeypatch.undo()
    flush_releases(sender)
    sender.send_layers(receiver.address, "good", 0, 0, *chunk(0, "cuda"))
    assert isinstance(receive(receiver, 1)[0], KVPayload)
    assert sender.ring.in_use == 1  # the rejected chunk's region came back


@needs_cuda
def test_placements_outside_the_buffer_or_malformed_are_dropped(
    sender: CudaIpcKVSender,
) -> None:
    reader = CudaIpcReader()
    k, _ = chunk(0)
    cases = {
        "outside": Placement("cuda_ipc", sender.segment, 2**20 - 64, 0, sender.handle),
        "negative": Placement("cuda_ipc", sender.segment, -64, 0, sender.handle),
        "short handle": Placement("cuda_ipc", "cuda-1-0123456789ab", 0, 0, b"x"),
        "bad name": Placement("cuda_ipc", "../etc/passwd", 0, 0, bytes(64)),
    }
    for name, placement in cases.items():
        with pytest.raises(BadChunk) as caught:
            reader.read(header_with(placement, k))
        assert caught.value.kind == "placement", name
    reader.close()


# --- on a GPU, two processes -------------------------------------------------------------------

COUNT = 6


def start_sender(address: str, ending: str) -> subprocess.Popen[str]:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.Popen(
        [sys.executable, __file__, address, str(COUNT), ending], cwd=ROOT, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=WAIT_S)


@needs_cuda
@pytest.mark.parametrize("ending", ["receiver_leaves", "sender_dies"])
def test_round_trip_between_two_processes(receiver: KVReceiver, ending: str) -> None:
    process = start_sender(receiver.address, ending)
    try:
        items = receive(receiver, COUNT)
        assert process.stdout is not None and process.stdin is not None
        segment, fallbacks = process.stdout.readline().split()
        assert fallbacks == "0"
        for item in items:
            assert isinstance(item, KVPayload) and item.header.placement is not None
            k, v = chunk(int(item.header.request_id), "cuda")
            assert torch.equal(item.k, k) and torch.equal(item.v, v)
        reader = receiver.readers["cuda_ipc"]
        assert isinstance(reader, CudaIpcReader) and list(reader.segments.opened) == [segment]
        size = reader.segments.opened[segment].size  # from the driver: offsets checked against it
        assert size is not None and size >= 4 * 2**20
        first = items[0]
        assert isinstance(first, KVPayload) and first.header.placement is not None
        placement = first.header.placement
        outside = Placement("cuda_ipc", segment, size, 0, placement.handle)
        with pytest.raises(BadChunk, match="outside"):
            reader.read(header_with(outside, chunk(0)[0]))
        if ending == "receiver_leaves":
            reader.close()  # before the sender frees its buffer
        process.stdin.write("done\n")
        process.stdin.flush()
        assert process.wait(timeout=WAIT_S) == 0
        reader.segments.close_dead()  # the sender is gone: its handle closes
        assert reader.segments.opened == {}
        torch.cuda.synchronize()  # this process's CUDA context is unharmed
    finally:
        stop(process)


def _run_sender(address: str, count: int, ending: str) -> None:
    """The other process: send `count` chunks, say so, then wait for the word to end."""
    context = zmq.Context()
    sender = make_sender(context, KVTransferConfig(backend="cuda_ipc", buffer_mb=4))
    assert isinstance(sender, CudaIpcKVSender)
    for seed in range(count):
        sender.send_layers(address, str(seed), 0, 0, *chunk(seed, "cuda"))
    print(sender.segment, sender.inline_fallbacks, flush=True)
    sys.stdin.readline()
    if ending == "sender_dies":
        os._exit(0)  # as if killed: nothing freed, nothing closed
    sender.close()
    context.destroy(linger=0)


if __name__ == "__main__":
    _run_sender(sys.argv[1], int(sys.argv[2]), sys.argv[3])
