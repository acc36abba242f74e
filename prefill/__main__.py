"""`python -m prefill --config configs/default.yaml --worker-id prefill-0`"""

import core.threads  # noqa: F401 (first: it sets how OpenMP threads wait, before torch loads)
from core.config import Config
from core.process import worker_main
from engine.runner import load_runner
from prefill.worker import PrefillWorker


def build(worker_id: str, config: Config) -> PrefillWorker:
    runner = load_runner(config.model, config.prefill, config.engine, config.sim)
    return PrefillWorker(worker_id, config, runner)


if __name__ == "__main__":
    worker_main("prefill", build)
