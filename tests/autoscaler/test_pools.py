"""The host's pool scaler: bounds, the gateway's wishes read from /metrics, workers started
all at once and drained one a round, the newest first, never the ones launch.sh started."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from autoscaler.pools import Bounds, LaunchedWorkers, PoolScaler, desired_workers, join_command
from core.config import Role

# A stand-in for a launch.sh --join: a real process that exits on SIGTERM (as a drained worker
# does) and on SIGINT.
# SIGINT ends it even where the test runs with SIGINT ignored (a shell's background job), which
# a child inherits and Python then leaves as it is.
WORKER = [sys.executable, "-c", "import signal, time; "
          "signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(60)"]


@pytest.fixture
def scaler() -> Iterator[tuple[PoolScaler, list[Role]]]:
    started: list[Role] = []

    def start(role: Role, number: int) -> subprocess.Popen[bytes]:
        started.append(role)
        return subprocess.Popen(WORKER)

    pools = PoolScaler(Bounds(1, 3), {"prefill": 1, "decode": 1}, start)
    yield pools, started
    pools.stop()


def test_bounds_parse_min_max() -> None:
    assert Bounds.parse("1:4") == Bounds(1, 4)
    for bad in ("4:1", "0:2", "3", "a:b", "1:"):
        with pytest.raises(ValueError, match="MIN:MAX"):
            Bounds.parse(bad)


def test_the_wishes_are_read_from_the_metrics_text() -> None:
    text = ('# HELP raging_pool_desired_workers ...\n'
            'raging_pool_desired_workers{role="prefill"} 2.0\n'
            'raging_pool_desired_workers{role="decode"} 5.0\n'
            'raging_workers{role="decode"} 1.0\n')
    assert desired_workers(text) == {"prefill": 2, "decode": 5}
    assert desired_workers('raging_pool_desired_workers{role="decode"} 5.0\n') is None


def test_a_pool_grows_at_once_within_its_bounds(scaler: tuple[PoolScaler, list[Role]]) -> None:
    pools, started = scaler
    pools.adjust({"prefill": 1, "decode": 9})
    assert started == ["decode", "decode"] and pools.size("decode") == 3  # at most 3
    pools.adjust({"prefill": 1, "decode": 9})
    assert len(started) == 2  # already there


def test_a_pool_shrinks_one_worker_a_round_newest_first_never_below_its_base(
        scaler: tuple[PoolScaler, list[Role]]) -> None:
    pools, _ = scaler
    pools.adjust({"prefill": 1, "decode": 3})
    first, second = pools.started["decode"].running
    pools.adjust({"prefill": 1, "decode": 0})
    assert pools.started["decode"].running == [first] and pools.size("decode") == 2
    assert second.wait(timeout=10) is not None  # SIGTERM: it went
    pools.adjust({"prefill": 1, "decode": 0})
    assert pools.size("decode") == 1 and first.wait(timeout=10) is not None
    pools.adjust({"prefill": 0, "decode": 0})
    assert pools.size("decode") == 1 and pools.size("prefill") == 1  # launch.sh's own stay
    pools.started["decode"].reap()
    assert pools.started["decode"].draining == []


def test_stop_ends_every_worker_it_started(scaler: tuple[PoolScaler, list[Role]]) -> None:
    pools, _ = scaler
    pools.adjust({"prefill": 3, "decode": 2})
    every = [*pools.started["prefill"].running, *pools.started["decode"].running]
    assert len(every) == 3
    pools.stop()
    assert all(p.poll() is not None for p in every)


def test_a_started_worker_joins_with_the_clusters_address_and_keys() -> None:
    command = join_command(Path("/r/scripts/launch.sh"), "tcp://10.0.0.1:8100", "/k", "decode",
                           Path("/run/scaled-decode-3"), ["--config", "c.yaml"])
    assert command == ["/r/scripts/launch.sh", "--join", "tcp://10.0.0.1:8100", "--keys", "/k",
                       "--decode", "1", "--run-dir", "/run/scaled-decode-3", "--config", "c.yaml"]


def test_launch_sh_s_own_workers_count_while_they_run_and_a_grace_after(tmp_path: Path) -> None:
    """Read from launch.sh's pids file (a restarted worker's newest PID last): one that died
    counts for `grace_s` (launch.sh may be starting it again), then no more."""
    running = subprocess.Popen(WORKER)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    try:
        pids = tmp_path / "pids"
        pids.write_text(f"{gone.pid} gateway\n{gone.pid} decode-0\n{running.pid} decode-0\n"
                        f"{running.pid} prefill-0\n{gone.pid} decode-1\n")
        launched = LaunchedWorkers(tmp_path, grace_s=5.0)
        assert (launched.count("decode", now=100.0), launched.count("prefill", 100.0)) == (2, 1)
        assert launched.count("decode", now=104.0) == 2  # decode-1 may come back yet
        assert launched.count("decode", now=105.0) == 1  # it did not
        pids.write_text(pids.read_text() + f"{running.pid} decode-1\n")  # restarted
        assert launched.count("decode", now=106.0) == 2
    finally:
        running.kill()
        running.wait(timeout=30)


def test_a_pool_whose_own_worker_left_is_made_up_for() -> None:
    """A worker launch.sh started drained away (or ran out of restarts): the pool would stay
    below its least size for good unless the scaler starts one in its place."""
    started: list[Role] = []
    own = {"prefill": 1, "decode": 1}

    def start(role: Role, number: int) -> subprocess.Popen[bytes]:
        started.append(role)
        return subprocess.Popen(WORKER)

    pools = PoolScaler(Bounds(1, 3), {"prefill": 1, "decode": 1}, start, own.__getitem__)
    try:
        pools.adjust({"prefill": 1, "decode": 1})
        assert started == []
        own["decode"] = 0  # decode-0 left
        pools.adjust({"prefill": 1, "decode": 1})
        assert started == ["decode"] and pools.size("decode") == 1
    finally:
        pools.stop()
