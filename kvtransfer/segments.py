"""The senders' staging segments a receiver has opened, shared by the shm and CUDA readers."""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from core.pids import alive
from kvtransfer.base import BadChunk

T = TypeVar("T")
_MAX_OPEN = 64
_SWEEP_S = 5.0  # how often to look for senders that are gone
# A segment unused this long is closed (opened again if a chunk names it): a sender's PID says
# nothing from another PID namespace (containers), so PIDs alone must not keep it open.
IDLE_CLOSE_S = 120.0


def segment_owner(prefix: str, name: str) -> int | None:
    """The owner's PID in a segment name `<prefix>-<pid>-<12 hex>`; None if it is not one."""
    match = re.fullmatch(re.escape(prefix) + r"-(\d+)-[0-9a-f]{12}", name)
    return int(match.group(1)) if match else None


class OpenSegments(Generic[T]):
    """Segments by name (`<prefix>-<owner pid>-<12 hex>`), each opened once: at most 64, the
    least recently used closed first, those whose owner process is gone and those unused for
    `idle_close_s` closed within seconds of the next use, so a sender that leaves does not pin
    its memory here."""

    def __init__(self, prefix: str, closer: Callable[[T], None],
                 idle_close_s: float = IDLE_CLOSE_S) -> None:
        self.prefix = prefix
        self.closer = closer
        self.idle_close_s = idle_close_s
        self.opened: OrderedDict[str, T] = OrderedDict()
        self.used: dict[str, float] = {}  # name: when a chunk last named it
        self.swept = time.monotonic()

    def get(self, name: str, opener: Callable[[str], T]) -> T:
        """Segment `name`, opened by `opener` unless it is open already; BadChunk if the name
        is not one of ours."""
        self._sweep_now_and_then()
        self.used[name] = time.monotonic()
        if name in self.opened:
            self.opened.move_to_end(name)
            return self.opened[name]
        if self.owner(name) is None:
            raise BadChunk("placement", f"not a KV segment name: {name[:80]!r}")
        self.close_dead()
        segment = opener(name)
        if len(self.opened) >= _MAX_OPEN:
            self._close(next(iter(self.opened)))
        self.opened[name] = segment
        return segment

    def owner(self, name: str) -> int | None:
        return segment_owner(self.prefix, name)

    def close_dead(self) -> None:
        """Close the segments whose owner process is gone or that have been idle too long."""
        idle_since = time.monotonic() - self.idle_close_s
        for name in [n for n in self.opened
                     if not alive(self.owner(n) or 0) or self.used.get(n, 0) < idle_since]:
            self._close(name)

    def _close(self, name: str) -> None:
        self.closer(self.opened.pop(name))
        self.used.pop(name, None)

    def _sweep_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self.swept >= _SWEEP_S:
            self.swept = now
            self.close_dead()

    def close(self) -> None:
        for segment in self.opened.values():
            self.closer(segment)
        self.opened.clear()
        self.used.clear()
