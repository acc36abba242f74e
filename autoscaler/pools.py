"""Sizing the pools on one host (`launch.sh --autoscale MIN:MAX`): every few seconds, read the
gateway's `raging_pool_desired_workers{role}` and make each pool that size, within MIN and
MAX workers, by starting workers (`launch.sh --join`, one worker each) and draining the newest
it started (SIGTERM: it finishes what it holds, then leaves). The workers launch.sh started
itself count toward a pool while they run (`LaunchedWorkers`) and are never drained from here:
one that left (drained, or past its restarts) is made up for."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.config import ROLES, Role
from core.pids import alive, started_pids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bounds:
    """Each pool's size between `least` and `most` workers."""

    least: int
    most: int

    @classmethod
    def parse(cls, text: str) -> Bounds:
        """`MIN:MAX`, as launch.sh --autoscale takes it."""
        least, sep, most = text.partition(":")
        if not (sep and least.isdigit() and most.isdigit() and 0 < int(least) <= int(most)):
            raise ValueError(f"--autoscale takes MIN:MAX with 0 < MIN <= MAX, not {text!r}")
        return cls(int(least), int(most))


@dataclass
class Started:
    """Workers this scaler started for one pool, oldest first, and those it is draining."""

    running: list[subprocess.Popen[bytes]] = field(default_factory=list)
    draining: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def reap(self) -> None:
        """Forget the workers that have exited (a drained one, or one that failed)."""
        self.running = [p for p in self.running if p.poll() is None]
        self.draining = [p for p in self.draining if p.poll() is None]


class LaunchedWorkers:
    """The workers launch.sh started itself, as its run folder's `pids` file names them. One
    counts while its process runs, and for `grace_s` after it died, while launch.sh may be
    starting it again."""

    def __init__(self, run_dir: Path, grace_s: float = 10.0) -> None:
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.dead_since: dict[str, float] = {}  # name: when it was first seen not running

    def count(self, role: Role, now: float) -> int:
        present = 0
        for name, pid in started_pids(self.run_dir).items():
            if not name.startswith(f"{role}-"):
                continue
            if alive(pid):
                self.dead_since.pop(name, None)
                present += 1
            elif now - self.dead_since.setdefault(name, now) < self.grace_s:
                present += 1
        return present


class PoolScaler:
    """One round at a time (`adjust`), given what the gateway wants (`desired`) and how to
    start one worker of a pool (`start`). `launched`: the workers launch.sh started itself,
    per pool (a pool it started none of stays empty); `launched_now`, how many of them run
    now (all of them, when not given)."""

    def __init__(self, bounds: Bounds, launched: dict[Role, int],
                 start: Callable[[Role, int], subprocess.Popen[bytes]],
                 launched_now: Callable[[Role], int] | None = None) -> None:
        self.bounds = bounds
        self.launched = launched
        self.launched_now = launched_now or launched.__getitem__
        self.start = start
        self.started: dict[Role, Started] = {role: Started() for role in ROLES}
        self.count = 0  # workers started so far: each one's number

    def size(self, role: Role) -> int:
        """The pool's workers that are not draining."""
        return self.launched_now(role) + len(self.started[role].running)

    def adjust(self, desired: dict[Role, int]) -> None:
        """Start or drain workers so that each pool heads for its wanted size: all the missing
        ones at once, one fewer a round (the gateway spaces its wishes to shrink)."""
        for role in ROLES:
            pool = self.started[role]
            pool.reap()
            wanted = min(max(desired[role], self.bounds.least if self.launched[role] else 0),
                         self.bounds.most)
            for _ in range(wanted - self.size(role)):
                self.count += 1
                pool.running.append(self.start(role, self.count))
                log.info("%s pool: started a worker (%d wanted)", role, wanted)
            if wanted < self.size(role) and pool.running:
                newest = pool.running.pop()
                newest.send_signal(signal.SIGTERM)  # its launch.sh drains its worker
                pool.draining.append(newest)
                log.info("%s pool: draining a worker (%d wanted)", role, wanted)

    def stop(self) -> None:
        """Stop every worker it started at once (SIGINT), as launch.sh stops its own."""
        every = [p for pool in self.started.values() for p in (*pool.running, *pool.draining)]
        for process in every:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in every:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def desired_workers(metrics: str) -> dict[Role, int] | None:
    """`raging_pool_desired_workers{role}` from /metrics text (None before it has both)."""
    found: dict[Role, int] = {}
    for line in metrics.splitlines():
        for role in ROLES:
            if line.startswith(f'raging_pool_desired_workers{{role="{role}"}} '):
                found[role] = int(float(line.rpartition(" ")[2]))
    return found if len(found) == len(ROLES) else None


def join_command(launch: Path, control: str, keys: str, role: Role, run_dir: Path,
                 extra: Sequence[str]) -> list[str]:
    """launch.sh starting one worker of `role` that joins the cluster at `control`."""
    return [str(launch), "--join", control, "--keys", keys, f"--{role}", "1",
            "--run-dir", str(run_dir), *extra]


def run(scaler: PoolScaler, read_metrics: Callable[[], str], every_s: float,
        stopping: Callable[[], bool]) -> None:
    """Adjust the pools every `every_s` until `stopping()`; then stop what it started."""
    try:
        while not stopping():
            try:
                desired = desired_workers(read_metrics())
            except OSError as exc:  # the gateway is starting, or gone: ask again next round
                log.warning("cannot read the gateway's metrics: %s", exc)
                desired = None
            if desired is not None:
                scaler.adjust(desired)
            time.sleep(every_s)
    finally:
        scaler.stop()
