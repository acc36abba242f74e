"""KV transfer bandwidth between two processes, against a plain memcpy of the same bytes.

    python -m bench transfer [--tokens 512,2048,8192] [--repeats 5] [--curve]

The receiver runs in its own process (`python -m bench.transfer_peer`) and the KV goes as the
prefill worker sends it: layers grouped into chunks of about kv_transfer.chunk_mb, then a
notice. Every timing moves at least 128 MB: several distinct requests back to back when one
is smaller, and memcpy copies the same requests. Each figure includes what a real
hand-off pays: framing, checksums on both sides, the socket or the staging copy, the copy out.
KV is shaped like the default model's: [30 layers, tokens, 3 kv heads, 64] fp32, 46 KB per
token for K and V together. On a host with CUDA and cupy, cuda_ipc is measured too, against a
device-to-device copy. With --curve, the sockets are CURVE-authenticated and encrypted, as
launch.sh runs them (core/curve.py): inline KV (zmq) is encrypted byte by byte, while shm and
cuda_ipc only send headers through the sockets.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from core.config import KVTransferConfig
from core.cpus import running_on
from core.curve import generate, load
from kvtransfer import KVSender, make_sender
from kvtransfer.sender import layers_per_chunk

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
_CPUS = sorted(os.sched_getaffinity(0))
_SENDER_CPUS, _PEER_CPU = (str(_CPUS[0]), _CPUS[1]) if len(_CPUS) >= 2 else ("", None)


@dataclass(frozen=True)
class TransferFigure:
    backend: str
    tokens: int
    megabytes: float
    gb_per_s: float  # median over the repeats
    memcpy_gb_per_s: float

    @property
    def ratio(self) -> float:
        return self.gb_per_s / self.memcpy_gb_per_s


@dataclass(frozen=True)
class Backend:
    name: str
    config: KVTransferConfig
    bind: str
    device: str = "cpu"
    keys_dir: str = ""  # CURVE keys for both ends; "" for plain ZeroMQ


KV = tuple[torch.Tensor, torch.Tensor]


def requests_of(tokens: int, min_bytes: int, device: str = "cpu") -> list[KV]:
    """The K and V of as many distinct requests as make up `min_bytes` (at least one): every
    timing moves all of them, so small requests measure throughput rather than latency, and
    neither side reads a source that is still in cache from the last request."""
    shape = (LAYERS, tokens, KV_HEADS, HEAD_DIM)
    count = max(1, -(-min_bytes // (2 * 4 * LAYERS * tokens * KV_HEADS * HEAD_DIM)))
    return [(torch.randn(shape, device=device), torch.randn(shape, device=device))
            for _ in range(count)]


def nbytes(requests: list[KV]) -> int:
    return sum(k.nbytes + v.nbytes for k, v in requests)


def memcpy_gb_per_s(requests: list[KV], repeats: int) -> float:
    """Each request's K and V copied into one reused pair of targets, as a receiver would."""
    targets = (torch.empty_like(requests[0][0]), torch.empty_like(requests[0][1]))

    def copy() -> None:
        for k, v in requests:
            targets[0].copy_(k)
            targets[1].copy_(v)
        if targets[0].is_cuda:
            torch.cuda.synchronize()
    return nbytes(requests) / _median_seconds(copy, repeats) / 1e9


def _median_seconds(action: Callable[[], None], repeats: int) -> float:
    action()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Peer:
    """The receiving process: it prints its address, then one line per request it received."""

    def __init__(self, bind: str, cpu: int | None, keys_dir: str = "") -> None:
        pinning = [] if cpu is None else ["--cpu", str(cpu)]
        keys = ["--keys-dir", keys_dir] if keys_dir else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer_peer", "--bind", bind, *pinning, *keys],
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().strip()

    def wait_for_request(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def transfer_gb_per_s(backend: Backend, requests: list[KV], repeats: int) -> float:
    """The requests sent back to back, each as chunks of layers then a notice, until every one
    arrived."""
    peer = Peer(backend.bind, _PEER_CPU, backend.keys_dir)
    context = zmq.Context()
    keys = load(Path(backend.keys_dir)) if backend.keys_dir else None
    sender = make_sender(context, backend.config, keys)
    count = 0

    def hand_off() -> None:
        nonlocal count
        ids = [f"bench-{count + i}" for i in range(len(requests))]
        count += len(requests)
        chunks = [_send(sender, peer.address, request_id, k, v, backend.config.chunk_mb)
                  for request_id, (k, v) in zip(ids, requests, strict=True)]
        for request_id, sent in zip(ids, chunks, strict=True):
            got = peer.wait_for_request()
            assert got == f"{request_id} {sent}", f"the receiver got {got!r}"
    try:
        return nbytes(requests) / _median_seconds(hand_off, repeats) / 1e9
    finally:
        try:
            sender.close()
            context.term()
        finally:
            peer.stop()


def _send(sender: KVSender, address: str, request_id: str, k: torch.Tensor, v: torch.Tensor,
          chunk_mb: float) -> int:
    """Send one request's KV as the prefill worker does; the number of chunks."""
    group = layers_per_chunk((k.nbytes + v.nbytes) // LAYERS, int(chunk_mb * 2**20))
    starts = range(0, LAYERS, group)
    for start in starts:
        end = min(start + group, LAYERS)
        sender.send_layers(address, request_id, 0, start, k[start:end], v[start:end])
    sender.notify(address, request_id, 0, b"")
    return len(starts)


def backends(folder: Path, keys_dir: str = "") -> list[Backend]:
    """Every backend this host runs; with `keys_dir`, over CURVE (named "+curve")."""
    tag = " +curve" if keys_dir else ""
    found = [
        Backend(f"zmq tcp{tag}", KVTransferConfig(backend="zmq"), "tcp://127.0.0.1:*",
                keys_dir=keys_dir),
        Backend(f"zmq ipc{tag}", KVTransferConfig(backend="zmq"), f"ipc://{folder}/kv.sock",
                keys_dir=keys_dir),
        Backend(f"shm{tag}", KVTransferConfig(backend="shm"), f"ipc://{folder}/shm.sock",
                keys_dir=keys_dir),
    ]
    if cuda_ready():
        config = KVTransferConfig(backend="cuda_ipc", buffer_mb=256)
        found.append(Backend(f"cuda_ipc{tag}", config, f"ipc://{folder}/cuda.sock", "cuda",
                             keys_dir))
    return found


def cuda_ready() -> bool:
    """Whether this host can run the cuda_ipc backend (a CUDA torch and cupy)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def measure(token_counts: tuple[int, ...], repeats: int, min_mb: int = 128,
            curve: bool = False, only: tuple[str, ...] = ()) -> list[TransferFigure]:
    """Sender and receiver each get one core and one thread, as the workers do; `curve`:
    over CURVE sockets; `only`: the backends whose names start with one of these (all when
    empty)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with running_on(_SENDER_CPUS):
            return _measure(token_counts, repeats, min_mb, curve, only)
    finally:
        torch.set_num_threads(threads)


def _measure(token_counts: tuple[int, ...], repeats: int, min_mb: int, curve: bool,
             only: tuple[str, ...]) -> list[TransferFigure]:
    figures = []
    with tempfile.TemporaryDirectory(prefix="raging-transfer-") as folder:
        keys_dir = f"{folder}/keys" if curve else ""
        if curve:
            generate(Path(keys_dir))
        for tokens in token_counts:
            for backend in backends(Path(folder), keys_dir):
                if only and not backend.name.startswith(only):
                    continue
                requests = requests_of(tokens, min_mb * 2**20, backend.device)
                baseline = memcpy_gb_per_s(requests, repeats)
                rate = transfer_gb_per_s(backend, requests, repeats)
                megabytes = nbytes(requests[:1]) / 2**20
                figures.append(TransferFigure(backend.name, tokens, megabytes, rate, baseline))
    return figures


def markdown(figures: list[TransferFigure]) -> str:
    rows = ["| backend | tokens | MB | GB/s | memcpy GB/s | ratio |", "|---|---|---|---|---|---|"]
    rows += [f"| {f.backend} | {f.tokens} | {f.megabytes:.0f} | {f.gb_per_s:.2f} | "
             f"{f.memcpy_gb_per_s:.2f} | {f.ratio:.2f}x |" for f in figures]
    return "\n".join(rows)
