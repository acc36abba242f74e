"""`python -m decode --config configs/default.yaml --worker-id decode-0`"""

from decode.worker import DecodeWorker
from engine.loading import worker_main

if __name__ == "__main__":
    worker_main("decode", DecodeWorker)
