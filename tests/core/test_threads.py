"""Workers' OpenMP threads spin briefly between parallel regions, then sleep, unless the
environment says otherwise; set before anything loads torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.threads import SPIN_COUNT
from tests.openmp_probe import needs_two_cpus, probe

ROOT = Path(__file__).resolve().parents[2]
READ = ("import core.threads, os; print(os.environ.get('OMP_WAIT_POLICY', '-'), "
        "os.environ.get('GOMP_SPINCOUNT', '-'))")
def _without_policy() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


@pytest.mark.parametrize(("given", "expected"), [
    ({}, f"ACTIVE {SPIN_COUNT}"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE -"),
    ({"GOMP_SPINCOUNT": "0"}, "- 0"),
])
def test_a_short_spin_unless_the_environment_says_otherwise(
        given: dict[str, str], expected: str) -> None:
    out = subprocess.run([sys.executable, "-c", READ], env={**_without_policy(), **given},
                         cwd=ROOT, check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == expected


@needs_two_cpus
@pytest.mark.usefixtures("quiet_cpus")
def test_threads_spin_through_a_step_and_sleep_when_idle() -> None:
    waits = probe()
    assert waits.sleeps < 40  # of 400 regions
    assert waits.idle_cpu_s < 0.1  # of 0.5 s


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_worker_sets_it_before_any_other_import(role: str) -> None:
    tree = ast.parse((ROOT / role / "__main__.py").read_text())
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    first = imports[0]
    assert isinstance(first, ast.Import) and first.names[0].name == "core.threads"
