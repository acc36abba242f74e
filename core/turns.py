"""Workers on the same CPUs take turns computing: a lock file per CPU set, held for each forward
pass.

A worker's torch threads fill the CPUs it may run on. Two such workers computing at once (the
README's `--prefill 2 --decode 6` on two cores: a prefill step beside a decode step) put four
threads on two cores, and each of a step's ~300 parallel regions waits for whichever of its
threads the scheduler left out. Taking turns, each step runs alone, at the full width of the
CPUs: at c=32 that layout went from 113 to 129 output tokens/s (docs/scheduling.md). Workers
on different CPU sets hold different files and never wait for each other.

A turn is waited for `patience_s` at most: past it the waiting worker computes beside the
holder until it lets go. A holder stopped or wedged in a step would otherwise stall every worker
on its CPUs, and the gateway would declare them all stalled. A step is one forward pass, a
fraction of a second for the default model on two cores; a larger model's long prefill steps can
take longer than the patience, and the steps of the others then overlap them (raise
`engine.cpu_turn_patience_s`, below the gateway's stall timeout, to keep them apart).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)


def turns_file(folder: Path, cpus: Sequence[int]) -> Path:
    """The lock file of the workers that run on exactly `cpus`."""
    return folder / f"cpus-{'-'.join(str(cpu) for cpu in sorted(cpus))}.lock"


class CpuTurns:
    """`with turns:` waits for this CPU set's turn and holds it for the block, or, past
    `patience_s`, goes on without it; a no-op where no folder is given. A waiting worker sleeps
    in the lock, taking no CPU."""

    def __init__(self, folder: str, cpus: Sequence[int], patience_s: float = 3.0) -> None:
        self.cpus = tuple(cpus)
        self.patience_s = patience_s
        self.skipped = 0  # steps computed without the turn, beside a holder that kept it
        self._taker: _TurnTaker | None = None
        self._held = False
        self._warned_at = 0.0  # the start of the last wait a warning was logged for
        if folder:
            path = Path(folder).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(turns_file(path, cpus), os.O_CREAT | os.O_RDWR, 0o600)
            self._taker = _TurnTaker(fd)

    def __enter__(self) -> None:
        if self._taker is None:
            return
        self._held = self._taker.take(self.patience_s)
        if not self._held:
            self.skipped += 1
            if self._warned_at != self._taker.stuck_since:  # once a wait
                self._warned_at = self._taker.stuck_since
                log.info("the turn of CPUs %s was held over %g s (a long step, or a stopped "
                         "or wedged holder): computing beside its holder until it lets go",
                         ",".join(map(str, self.cpus)), self.patience_s)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._held:
            assert self._taker is not None
            self._taker.give_back()
            self._held = False

    def close(self) -> None:
        if self._taker is not None:
            self._taker.close()
            self._taker = None


class _TurnTaker:
    """Takes a lock file's turn: at once when it is free, else from a thread of its own, so that
    the wait can end at a deadline (flock has none). A wait outlives the step that gave up on
    it: later steps go on at once while it lasts, and once the holder lets go the turn is taken
    for the step waiting then, or given back straight away when none is."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.state = threading.Condition()
        self.blocked = False  # the thread waits in flock for the turn
        self.wanted = False  # a step waits for the thread to take it
        self.taken = False  # the thread took it for that step
        self.stuck_since = 0.0  # when the thread's wait began
        self.thread: threading.Thread | None = None

    def take(self, patience_s: float) -> bool:
        """Whether the turn is this process's now: free, or let go within `patience_s` of
        when the wait for it began."""
        with self.state:
            if not self.blocked:
                if _try_lock(self.fd):
                    return True
                self.blocked, self.stuck_since = True, time.monotonic()
                self._start()
                self.state.notify_all()
            self.wanted = True
            deadline = self.stuck_since + patience_s
            try:
                self.state.wait_for(lambda: self.taken, max(0.0, deadline - time.monotonic()))
            except BaseException:  # re-raised: a turn taken meanwhile must not stay held
                if self.taken:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                raise
            finally:
                self.wanted = False
                taken, self.taken = self.taken, False
            return taken

    def give_back(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self.state:
            if self.blocked:
                return  # the thread still waits in the file: the process's exit closes it
            os.close(self.fd)

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="cpu-turn", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            with self.state:
                self.state.wait_for(lambda: self.blocked)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            with self.state:
                self.blocked = False
                if self.wanted:
                    self.taken = True
                    self.state.notify_all()
                else:  # the step gave up on it and went on: nobody wants it now
                    fcntl.flock(self.fd, fcntl.LOCK_UN)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
