"""`python -m engine [--config FILE] [--model NAME_OR_PATH] [--set ...]`: get a model ready for
workers, and print its folder.

Prepares the packaged model's folder if needed (engine.weights.folder), builds the C++ kernels
once, so that workers starting together need not, and times the quant products for each pool's
thread count (engine.weights.quant_rows), so that workers starting together need not either
(on a GPU, neither applies). `launch.sh` runs it before any worker.
"""

from __future__ import annotations

import dataclasses

from core.cli import ConfigParser
from core.config import PoolConfig
from core.cpus import pinned_cpus
from engine.kernels.cpu.build import kernels, use_isa
from engine.locate import resolve_model
from engine.runner import load_runner, torch_device


def main() -> None:
    parser = ConfigParser("python -m engine", "Prepare a model folder and kernels for raging.")
    config = parser.config(parser.parse_args())
    folder = resolve_model(config.model.name, config.model.cache_dir)
    simulated = config.model.sim_profile is not None
    if simulated or torch_device(config.model.device).type != "cpu":  # no kernels, no quant
        print(folder)
        return
    use_isa(config.engine.isa)
    kernels()
    if config.model.quant_rows < 0:
        for threads in sorted({*thread_counts(config.prefill), *thread_counts(config.decode)}):
            tiny_pool = dataclasses.replace(config.decode, threads=threads, cpus="",
                                            num_kv_blocks=1, tp=1)  # one process measures
            load_runner(config.model, tiny_pool, config.engine)
    print(folder)


def thread_counts(pool: PoolConfig) -> tuple[int, ...]:
    """The thread counts a worker of `pool` may run with: `threads`, or for 0 (one per CPU it
    is pinned to) one, as a worker pinned to a CPU of its own, or every CPU here, as one alone."""
    return (pool.threads,) if pool.threads else (1, len(pinned_cpus()))


if __name__ == "__main__":
    main()
