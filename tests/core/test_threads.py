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

ROOT = Path(__file__).resolve().parents[2]
READ = ("import core.threads, os; print(os.environ.get('OMP_WAIT_POLICY', '-'), "
        "os.environ.get('GOMP_SPINCOUNT', '-'))")
# Two threads, 400 parallel regions back to back, then half a second with nothing to do: how
# often the threads went to sleep during the regions, and the CPU seconds of the idle half
# second (a thread spinning on would take all of it).
SPIN_THEN_SLEEP = """
import core.threads
import os, resource, time
import torch

def sleeps():
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as status:
            total += sum(int(line.split()[1]) for line in status
                         if line.startswith("voluntary_ctxt_switches"))
    return total

def cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

torch.set_num_threads(2)
x = torch.ones(1 << 20)
x.sum()
before = sleeps()
for _ in range(400):
    x.sum()
during = sleeps() - before
time.sleep(0.05)
before = cpu_s()
time.sleep(0.5)
print(during, cpu_s() - before)
"""


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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="a team of two OpenMP threads spins only with two CPUs to spin on")
def test_threads_spin_through_a_step_and_sleep_when_idle() -> None:
    out = subprocess.run([sys.executable, "-c", SPIN_THEN_SLEEP], env=_without_policy(),
                         cwd=ROOT, check=True, capture_output=True, text=True, timeout=120)
    sleeps, idle_cpu_s = out.stdout.split()
    assert int(sleeps) < 40  # of 400 regions
    assert float(idle_cpu_s) < 0.1  # of 0.5 s


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_worker_sets_it_before_any_other_import(role: str) -> None:
    tree = ast.parse((ROOT / role / "__main__.py").read_text())
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    first = imports[0]
    assert isinstance(first, ast.Import) and first.names[0].name == "core.threads"
