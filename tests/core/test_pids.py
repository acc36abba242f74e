"""Processes by PID: whether one runs, and launch.sh's `pids` file read back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from core.pids import alive, started_pids


def test_a_running_process_is_alive_and_a_reaped_one_is_not() -> None:
    assert alive(os.getpid())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert not alive(gone.pid)


def test_each_name_gets_its_newest_pid(tmp_path: Path) -> None:
    assert started_pids(tmp_path) == {}  # launch.sh has written none yet
    (tmp_path / "pids").write_text("10 gateway\n11 decode-0\n\n12 decode-0\n")
    assert started_pids(tmp_path) == {"gateway": 10, "decode-0": 12}
