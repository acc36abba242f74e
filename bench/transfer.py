"""KV transfer bandwidth between two processes, against a plain memcpy of the same bytes.

    python -m bench transfer [--tokens 512,2048,8192] [--repeats 5]

The receiver runs in its own process (`python -m bench.transfer_peer`), so each figure
includes what a real hand-off pays: framing, checksum on both sides, the socket, the copy out
of the kernel. KV is shaped like the default model's: [30 layers, tokens, 3 kv heads, 64] fp32,
46 KB per token for K and V together.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from kvtransfer import make_sender

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


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


def kv_of(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYERS, tokens, KV_HEADS, HEAD_DIM)
    return torch.randn(shape), torch.randn(shape)


def memcpy_gb_per_s(k: torch.Tensor, v: torch.Tensor, repeats: int) -> float:
    targets = (torch.empty_like(k), torch.empty_like(v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        targets[0].copy_(k)
        targets[1].copy_(v)
        times.append(time.perf_counter() - start)
    return (k.nbytes + v.nbytes) / statistics.median(times) / 1e9


class Peer:
    """The receiving process: it prints its address, then one line per chunk it verified."""

    def __init__(self, bind: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer_peer", "--bind", bind],
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().strip()

    def wait_for_chunk(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def transfer_gb_per_s(bind: str, k: torch.Tensor, v: torch.Tensor, repeats: int) -> float:
    peer = Peer(bind)
    context = zmq.Context()
    sender = make_sender(context)
    try:
        times = []
        for i in range(repeats + 1):  # the first one connects and warms up
            start = time.perf_counter()
            sender.send(peer.address, f"bench-{i}", 0, b"", k, v)
            assert peer.wait_for_chunk() == f"bench-{i}", "the receiver rejected a chunk"
            times.append(time.perf_counter() - start)
        return (k.nbytes + v.nbytes) / statistics.median(times[1:]) / 1e9
    finally:
        sender.close()
        context.term()
        peer.stop()


def measure(token_counts: tuple[int, ...], repeats: int) -> list[TransferFigure]:
    figures = []
    with tempfile.TemporaryDirectory(prefix="raging-transfer-") as folder:
        backends = {"zmq tcp": "tcp://127.0.0.1:*", "zmq ipc": f"ipc://{Path(folder)}/kv.sock"}
        for tokens in token_counts:
            k, v = kv_of(tokens)
            baseline = memcpy_gb_per_s(k, v, repeats)
            for name, bind in backends.items():
                rate = transfer_gb_per_s(bind, k, v, repeats)
                figures.append(TransferFigure(name, tokens, (k.nbytes + v.nbytes) / 2**20,
                                              rate, baseline))
    return figures


def markdown(figures: list[TransferFigure]) -> str:
    rows = ["| backend | tokens | MB | GB/s | memcpy GB/s | ratio |", "|---|---|---|---|---|---|"]
    rows += [f"| {f.backend} | {f.tokens} | {f.megabytes:.0f} | {f.gb_per_s:.2f} | "
             f"{f.memcpy_gb_per_s:.2f} | {f.ratio:.2f}x |" for f in figures]
    return "\n".join(rows)
