"""Processes by PID: whether one still runs, and the ones launch.sh started (the `pids` file
in its run folder: a "PID NAME" line each, a restarted process's newest last)."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process `pid` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def started_pids(run_dir: Path) -> dict[str, int]:
    """Process name -> PID (the newest) of everything launch.sh started in `run_dir`."""
    path = run_dir / "pids"
    lines = path.read_text().splitlines() if path.exists() else []
    return {name: int(pid) for pid, name in (line.split() for line in lines if line.strip())}
