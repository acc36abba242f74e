"""How the kernels' OpenMP threads wait: imported first by each worker's `__main__`, before
torch loads libgomp, which reads `OMP_WAIT_POLICY` once, as it loads.

By default libgomp's threads go to sleep between parallel regions. A decode step runs about 300
of them (every product, norm and attention of 30 layers) with Python in between; on two cores
shared with the gateway, waking the sleeping thread for each waits on the scheduler. Measured
with `--colocated 1 --set decode.threads=2` on a 2-core AMD EPYC (2026-12-03): one stream's
inter-token latency 31 ms by default, 20 ms with the threads spinning; 32 streams: 141 output
tokens/s either way; an idle worker still sleeps (1 % of a core). A worker of one thread has no
other thread to wake. A value already in the environment is kept.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
