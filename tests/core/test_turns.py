"""Workers on the same CPUs compute in turn: processes holding one CPU set's turn never overlap;
other CPU sets, or no folder, never wait."""

from __future__ import annotations

import subprocess
import sys
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
