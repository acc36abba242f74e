"""How the kernels' OpenMP threads wait: imported first by each worker's `__main__`, before
torch loads libgomp, which reads `OMP_WAIT_POLICY` and `GOMP_SPINCOUNT` once, as it loads.

A decode step runs about 300 parallel regions (every product, norm and attention of 30 layers)
with Python in between. By default libgomp's threads go to sleep after a region, and on two
cores shared with the gateway waking them for the next waits on the scheduler: one stream's
inter-token latency 31 ms against 20 spinning (a 2-core AMD EPYC, 2026-12-03). Spinning
forever (`ACTIVE` alone: libgomp spins for minutes) keeps an idle worker's threads on the
cores, where other workers on the same CPUs need them: the README's `--prefill 2 --decode 6`
on two cores fell to 26 output tokens/s at c=32. So the threads spin `SPIN_COUNT` rounds
(about 0.2 ms: regions of a step are tens of microseconds apart) and then sleep. What the
environment already says is kept.

libgomp cuts every spin to 1,000 rounds once a process runs more OpenMP threads than it has
CPUs, which a second team in another thread of the worker is enough to do
(engine/sampling/grammar.py keeps torch off its thread for that reason).
"""

import os

SPIN_COUNT = 20_000

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
