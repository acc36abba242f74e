"""Workers on the same CPUs take turns computing: a lock file per CPU set, held for each forward
pass.

A worker's torch threads fill the CPUs it may run on. Two such workers computing at once (the
README's `--prefill 2 --decode 6` on two cores: a prefill step beside a decode step) put four
threads on two cores, and each of a step's ~300 parallel regions waits for whichever of its
threads the scheduler left out. Taking turns, each step runs alone, at the full width of the
CPUs: at c=32 that layout went from 113 to 129 output tokens/s (docs/scheduling.md). Workers
on different CPU sets hold different files and never wait for each other.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


def turns_file(folder: Path, cpus: Sequence[int]) -> Path:
    """The lock file of the workers that run on exactly `cpus`."""
    return folder / f"cpus-{'-'.join(str(cpu) for cpu in sorted(cpus))}.lock"


class CpuTurns:
    """`with turns:` waits for this CPU set's turn and holds it for the block; a no-op where no
    folder is given. Blocking in `flock` sleeps, so a waiting worker takes no CPU."""

    def __init__(self, folder: str, cpus: Sequence[int]) -> None:
        self._fd: int | None = None
        if folder:
            path = Path(folder).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(turns_file(path, cpus), os.O_CREAT | os.O_RDWR, 0o600)

    def __enter__(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
