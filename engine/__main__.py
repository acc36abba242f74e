"""`python -m engine [--config FILE] [--model NAME_OR_PATH] [--set ...]`: get a model ready for
workers, and print its folder.

Prepares the packaged model's folder if needed (engine.weights.folder), builds the C++ kernels
once, so that workers starting together need not, and times the quant products for each pool's
thread count (engine.weights.quant_rows), so that workers starting together need not either.
`launch.sh` runs it before any worker.
"""

from __future__ import annotations

import dataclasses

from core.cli import ConfigParser
from engine.kernels.cpu.build import kernels, use_isa
from engine.runner import load_runner
from engine.weights.folder import resolve_model


def main() -> None:
    parser = ConfigParser("python -m engine", "Prepare a model folder and kernels for raging.")
    config = parser.config(parser.parse_args())
    folder = resolve_model(config.model.name, config.model.cache_dir)
    use_isa(config.engine.isa)
    kernels()
    if config.model.quant_rows < 0:
        for threads in sorted({config.prefill.threads or 1, config.decode.threads or 1}):
            tiny_pool = dataclasses.replace(config.decode, threads=threads, cpus="",
                                            num_kv_blocks=1)
            load_runner(config.model, tiny_pool, config.engine)
    print(folder)


if __name__ == "__main__":
    main()
