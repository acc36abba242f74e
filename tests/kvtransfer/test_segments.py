"""The segments a receiver keeps open: one open per name, closed when their owner is gone, when
unused for a while (a PID proves nothing across PID namespaces), or on close."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvtransfer.base import BadChunk
from kvtransfer.segments import OpenSegments


def name_of(pid: int, tag: str = "0" * 12) -> str:
    return f"test-{pid}-{tag}"


def test_a_segment_opens_once_and_closes_with_the_reader() -> None:
    closed: list[str] = []
    segments = OpenSegments("test", closed.append)
    opened: list[str] = []

    def opener(name: str) -> str:
        opened.append(name)
        return name

    for _ in range(3):
        segments.get(name_of(os.getpid()), opener)
    assert opened == [name_of(os.getpid())]
    segments.close()
    assert closed == opened and segments.opened == {}


def test_a_name_not_of_the_pattern_is_refused() -> None:
    segments: OpenSegments[str] = OpenSegments("test", lambda _: None)
    with pytest.raises(BadChunk):
        segments.get("../../etc/passwd", lambda n: n)


def test_a_dead_owners_segment_closes() -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    closed: list[str] = []
    segments = OpenSegments("test", closed.append)
    dead = name_of(int(gone.stdout))
    segments.get(dead, lambda n: n)
    segments.close_dead()
    assert closed == [dead]


def test_an_idle_segment_closes_though_its_owner_looks_alive() -> None:
    closed: list[str] = []
    segments = OpenSegments("test", closed.append, idle_close_s=0.2)
    busy, idle = name_of(os.getpid(), "a" * 12), name_of(os.getpid(), "b" * 12)
    segments.get(idle, lambda n: n)
    deadline = time.monotonic() + 0.4
    while time.monotonic() < deadline:
        segments.get(busy, lambda n: n)
        time.sleep(0.05)
    segments.close_dead()
    assert closed == [idle] and list(segments.opened) == [busy]
    assert segments.get(idle, lambda n: n + " again") == idle + " again"  # reopened when named
