"""`python -m bench startup` against a real launch of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.startup import StartupRun, startup_markdown
from tests.e2e.cluster import ROOT, TEST_CONFIG

pytestmark = pytest.mark.e2e


def test_the_table_gives_the_first_run_and_the_median_of_the_others() -> None:
    runs = [StartupRun(9.0, 9.5, 1.0), StartupRun(4.0, 4.2, 0.3), StartupRun(5.0, 5.4, 0.5),
            StartupRun(6.0, 6.1, 0.4)]
    table = startup_markdown({"--prefill 1 --decode 1": runs, "--colocated 1": runs[:1]})
    assert "| `--prefill 1 --decode 1` | 4 | 9.00 / 9.50 / 1.00 | 5.00 / 5.40 / 0.40 |" in table
    assert "| `--colocated 1` | 1 | 9.00 / 9.50 / 1.00 | - |" in table


def test_two_launches_are_timed_to_ready_answered_and_stopped(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(TEST_CONFIG))
    out = tmp_path / "startup.json"
    flags = f"--prefill 1 --decode 1 --model {tiny_model_dir} --config {config}"
    done = subprocess.run([sys.executable, "-m", "bench", "startup", "--launch", flags,
                           "--runs", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [(label, runs)] = json.loads(out.read_text()).items()
    assert label == flags and len(runs) == 2
    for run in runs:
        assert 0 < run["ready_s"] < run["first_answer_s"] < 120 and 0 < run["stopped_s"] < 30
    assert f"| `{flags}` | 2 |" in done.stdout
