"""`python -m decode --config configs/default.yaml --worker-id decode-0`"""

import core.threads  # noqa: F401 (first: it sets how OpenMP threads wait, before torch loads)
from core.config import Config
from core.process import worker_main
from decode.worker import DecodeWorker
from engine.runner import load_runner


def build(worker_id: str, config: Config) -> DecodeWorker:
    runner = load_runner(config.model, config.decode, config.engine, config.sim)
    return DecodeWorker(worker_id, config, runner)


if __name__ == "__main__":
    worker_main("decode", build)
