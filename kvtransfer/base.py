"""What every backend shares: the error a send raises, and the counters it keeps."""

from __future__ import annotations

from dataclasses import dataclass


class TransferError(RuntimeError):
    """A chunk could not be handed to the transport (peer gone, queue full)."""


class BadChunk(ValueError):
    """A chunk that must be dropped: `kind` is a short label for metrics, the message says why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass
class TransferCounters:
    """Totals since start, on one side of one backend."""

    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0  # sends that raised

    def add(self, nbytes: int, seconds: float) -> None:
        self.chunks += 1
        self.bytes += nbytes
        self.seconds += seconds
