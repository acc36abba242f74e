"""KV transfer bandwidth between two processes, against a plain memcpy of the same bytes.

    python -m bench transfer [--tokens 512,2048,8192] [--repeats 5]

The receiver runs in its own process (`python -m bench.transfer_peer`) and the KV goes as the
prefill worker sends it: one chunk per layer, then a notice. Each figure includes what a real
hand-off pays: framing, checksums on both sides, the socket or the staging copy, the copy out.
KV is shaped like the default model's: [30 layers, tokens, 3 kv heads, 64] fp32, 46 KB per
token for K and V together. On a host with CUDA and cupy, cuda_ipc is measured too, against a
device-to-device copy.
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
from core.cpus import pin_to
from kvtransfer import make_sender

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


def kv_of(tokens: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYERS, tokens, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device), torch.randn(shape, device=device)


def memcpy_gb_per_s(k: torch.Tensor, v: torch.Tensor, repeats: int) -> float:
    targets = (torch.empty_like(k), torch.empty_like(v))

    def copy() -> None:
        targets[0].copy_(k)
        targets[1].copy_(v)
        if k.is_cuda:
            torch.cuda.synchronize()
    return (k.nbytes + v.nbytes) / _median_seconds(copy, repeats) / 1e9


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

    def __init__(self, bind: str, cpu: int | None) -> None:
        pinning = [] if cpu is None else ["--cpu", str(cpu)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer_peer", "--bind", bind, *pinning],
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().strip()

    def wait_for_request(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def transfer_gb_per_s(backend: Backend, k: torch.Tensor, v: torch.Tensor, repeats: int) -> float:
    peer = Peer(backend.bind, _PEER_CPU)
    context = zmq.Context()
    sender = make_sender(context, backend.config)
    count = 0

    def hand_off() -> None:
        nonlocal count
        request_id, count = f"bench-{count}", count + 1
        for layer in range(LAYERS):
            sender.send_layers(peer.address, request_id, 0, layer, k[layer:layer + 1],
                               v[layer:layer + 1])
        sender.notify(peer.address, request_id, 0, b"")
        got = peer.wait_for_request()
        assert got == f"{request_id} {LAYERS}", f"the receiver got {got!r}"
    try:
        return (k.nbytes + v.nbytes) / _median_seconds(hand_off, repeats) / 1e9
    finally:
        sender.close()
        context.term()
        peer.stop()


def backends(folder: Path) -> list[Backend]:
    found = [
        Backend("zmq tcp", KVTransferConfig(backend="zmq"), "tcp://127.0.0.1:*"),
        Backend("zmq ipc", KVTransferConfig(backend="zmq"), f"ipc://{folder}/kv.sock"),
        Backend("shm", KVTransferConfig(backend="shm", buffer_mb=64), f"ipc://{folder}/shm.sock"),
    ]
    if cuda_ready():
        config = KVTransferConfig(backend="cuda_ipc", buffer_mb=256)
        found.append(Backend("cuda_ipc", config, f"ipc://{folder}/cuda.sock", "cuda"))
    return found


def cuda_ready() -> bool:
    """Whether this host can run the cuda_ipc backend (a CUDA torch and cupy)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def measure(token_counts: tuple[int, ...], repeats: int) -> list[TransferFigure]:
    """Sender and receiver each get one core and one thread, as the workers do."""
    pin_to(_SENDER_CPUS)
    torch.set_num_threads(1)
    figures = []
    with tempfile.TemporaryDirectory(prefix="raging-transfer-") as folder:
        for tokens in token_counts:
            for backend in backends(Path(folder)):
                k, v = kv_of(tokens, backend.device)
                baseline = memcpy_gb_per_s(k, v, repeats)
                rate = transfer_gb_per_s(backend, k, v, repeats)
                figures.append(TransferFigure(backend.name, tokens,
                                              (k.nbytes + v.nbytes) / 2**20, rate, baseline))
    return figures


def markdown(figures: list[TransferFigure]) -> str:
    rows = ["| backend | tokens | MB | GB/s | memcpy GB/s | ratio |", "|---|---|---|---|---|---|"]
    rows += [f"| {f.backend} | {f.tokens} | {f.megabytes:.0f} | {f.gb_per_s:.2f} | "
             f"{f.memcpy_gb_per_s:.2f} | {f.ratio:.2f}x |" for f in figures]
    return "\n".join(rows)
