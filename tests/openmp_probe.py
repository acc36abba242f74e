"""How a worker's OpenMP threads wait, seen from a fresh process with the workers' settings
(core/threads.py): after `setup`, two threads run 400 parallel regions back to back (a sum over
1M floats each), then nothing for half a second."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import core.threads
import os, resource, sys, time
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
exec(sys.argv[1])
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
needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="a team of two OpenMP threads spins only with two CPUs to spin on")


@dataclass(frozen=True)
class Waits:
    sleeps: int  # times the threads went to sleep over the 400 regions
    idle_cpu_s: float  # CPU seconds the process took over the idle half second


def probe(setup: str = "", **policy: str) -> Waits:
    """The waits after `setup` (Python code), under the workers' defaults or `policy` (such as
    OMP_WAIT_POLICY="ACTIVE")."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(policy, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, setup], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=300)
    sleeps, idle = done.stdout.split()[-2:]
    return Waits(int(sleeps), float(idle))
