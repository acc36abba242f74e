"""`python -m prefill --config configs/default.yaml --worker-id prefill-0`"""

from engine.loading import worker_main
from prefill.worker import PrefillWorker

if __name__ == "__main__":
    worker_main("prefill", PrefillWorker)
