"""Workers on the same CPUs compute in turn: processes holding one CPU set's turn never overlap;
other CPU sets, or no folder, never wait."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from core.turns import CpuTurns, turns_file

ROOT = Path(__file__).resolve().parents[2]
# Holds the turn of CPUs argv[2] five times for 20 ms each; prints each hold's start and end.
HOLDER = """
import sys, time
from core.turns import CpuTurns
turns = CpuTurns(sys.argv[1], [int(cpu) for cpu in sys.argv[2].split(",")])
for _ in range(5):
    with turns:
        start = time.monotonic()
        time.sleep(0.02)
        print(start, time.monotonic(), flush=True)
    time.sleep(0.001)
turns.close()
"""


def _holds(folder: Path, cpu_sets: list[str]) -> list[list[tuple[float, float]]]:
    """Each process's holds, all processes started together."""
    processes = [subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), cpus], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True) for cpus in cpu_sets]
    holds = []
    for process in processes:
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        holds.append([(float(a), float(b)) for a, b in (line.split() for line in out.splitlines())])
    return holds


def _overlaps(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> int:
    return sum(a < d and c < b for a, b in first for c, d in second)


def test_processes_on_the_same_cpus_take_turns(tmp_path: Path) -> None:
    holds = _holds(tmp_path, ["0,1", "0,1", "0,1"])
    assert all(len(each) == 5 for each in holds)
    pairs = [(0, 1), (0, 2), (1, 2)]
    assert sum(_overlaps(holds[i], holds[j]) for i, j in pairs) == 0
    assert (tmp_path / "cpus-0-1.lock").exists()


def test_other_cpu_sets_compute_at_once(tmp_path: Path) -> None:
    holds = _holds(tmp_path, ["0", "1"])
    assert _overlaps(holds[0], holds[1]) > 0  # five holds of 20 ms each, side by side


def test_without_a_folder_nothing_waits() -> None:
    turns, other = CpuTurns("", [0]), CpuTurns("", [0])
    entered = False
    with turns, other:  # two holders of one lock file would wait for each other forever
        entered = True
    assert entered
    turns.close()
    other.close()


def test_the_file_names_the_cpu_set_in_order() -> None:
    assert turns_file(Path("/t"), [3, 0, 1]) == Path("/t/cpus-0-1-3.lock")


# Takes the turn of CPUs 0,1 in folder argv[1], says so, holds it argv[2] seconds, exits.
STUCK_HOLDER = """
import fcntl, os, sys, time
from pathlib import Path
from core.turns import turns_file
fd = os.open(turns_file(Path(sys.argv[1]), [0, 1]), os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holding(folder: Path, seconds: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", STUCK_HOLDER, str(folder), str(seconds)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def _free(folder: Path) -> bool:
    """Whether another process could take the turn now (a second open file is one)."""
    fd = os.open(turns_file(folder, [0, 1]), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_turn_let_go_within_patience_is_waited_for_and_held(tmp_path: Path) -> None:
    turns = CpuTurns(str(tmp_path), [0, 1], patience_s=5.0)
    holder = _holding(tmp_path, 0.3)
    began = time.monotonic()
    with turns:
        assert 0.2 < time.monotonic() - began < 3.0
        assert not _free(tmp_path)  # this process holds it for the block
    assert turns.skipped == 0 and _free(tmp_path)
    holder.wait(timeout=10)
    turns.close()


def test_a_holder_that_keeps_the_turn_is_computed_beside(tmp_path: Path) -> None:
    """A stopped or wedged holder: the first step waits out the patience, the next ones of the
    same wait go on at once; once it lets go, turns are taken again, and never kept idle."""
    turns = CpuTurns(str(tmp_path), [0, 1], patience_s=0.3)
    holder = _holding(tmp_path, 1.5)
    began = time.monotonic()
    with turns:
        assert 0.25 < time.monotonic() - began < 1.0
    began = time.monotonic()
    with turns:
        assert time.monotonic() - began < 0.1
    assert turns.skipped == 2
    holder.wait(timeout=10)
    time.sleep(0.1)  # the waiting thread takes it, nobody wants it: given back at once
    assert _free(tmp_path)
    with turns:
        assert not _free(tmp_path)
    assert turns.skipped == 2 and _free(tmp_path)
    turns.close()
