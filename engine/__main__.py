"""`python -m engine [--config FILE] [--model NAME_OR_PATH] [--set ...]`: get a model ready for
workers, and print its folder.

Prepares the packaged model's folder if needed (engine.weights.folder), builds the C++ kernels
once, so that workers starting together need not, and times the quant products for each pool's
thread count (engine.weights.quant_rows), so that workers starting together need not either
(on a GPU, neither applies). `launch.sh` runs it before any worker; where the folder's record
(engine.prepared) says all that is done for this config, it answers without importing torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from core.cli import ConfigParser
from core.config import Config
from engine.locate import resolve_model
from engine.prepared import is_prepared, record_prepared, thread_counts
from engine.weights.dtypes import resolve_dtype

if TYPE_CHECKING:
    from engine.runner import ModelRunner


def main() -> None:
    parser = ConfigParser("python -m engine", "Prepare a model folder and kernels for raging.")
    config = parser.config(parser.parse_args())
    folder = resolve_model(config.model.name, config.model.cache_dir)
    if config.model.sim_profile is None and not is_prepared(config, folder):
        prepare_for_workers(config, folder)
    print(folder)


def prepare_for_workers(config: Config, folder: Path) -> None:
    """Build the kernels and measure the quant rows for `config`'s pools, then record it."""
    # Imported here: a prepared folder is answered for without torch, ~2 s sooner.
    from engine.kernels.cpu.build import build_problem, has_compiler, kernels, use_isa
    from engine.runner import ModelRunner, load_runner, torch_device

    if torch_device(config.model.device).type != "cpu":  # no kernels, no quant rows
        return
    use_isa(config.engine.isa)
    module = kernels()
    measured = True
    if config.model.quant_rows < 0:
        for threads in thread_counts(config):
            tiny_pool = dataclasses.replace(config.decode, threads=threads, cpus="",
                                            num_kv_blocks=1, tp=1)  # one process measures
            runner = load_runner(config.model, tiny_pool, config.engine)
            assert isinstance(runner, ModelRunner)  # tp 1, on the CPU
            measured = measured and rows_kept(config, folder, runner)
    # Not recorded: a build that failed where a compiler is, or rows left unmeasured (dense
    # copies that did not fit this time), which the next start must try again.
    if measured and (build_problem() is None or not has_compiler()):
        record_prepared(config, folder,
                        Path(module.__file__) if module and module.__file__ else None)


def rows_kept(config: Config, folder: Path, runner: ModelRunner) -> bool:
    """Whether `runner`'s quant rows, at the thread count torch runs with now, are kept in
    `folder`, where it has any to measure (quant blocks beside dense matrices)."""
    from engine.weights.quant_rows import MeasuredQuantRows

    if not any(matrix.quant and matrix.matrices for matrix in runner.model.matrices()):
        return True
    rows = MeasuredQuantRows(folder, config.model.quant_inputs)
    return rows.get(resolve_dtype(config.model.dtype, "cpu")) is not None


if __name__ == "__main__":
    main()
