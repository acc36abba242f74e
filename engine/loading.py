"""Building a worker's model runtime from config, and its KV layout fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from core.cli import base_parser, config_from_args, setup_logging
from core.config import ModelConfig, WorkerConfig
from core.cpus import pin_to
from core.worker import RegistrationRefused, Worker
from engine.kernels import kernels, kernels_digest
from engine.linear import cpu_flags, fast_bf16
from engine.prepare import resolve_model
from engine.runner import ModelRunner, set_threads
from engine.spec import ModelSpec

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(name: str) -> str:
    """The dtype `model.dtype` names. "auto" is bfloat16 where the CPU multiplies bf16 in
    hardware (2.5-3.9x faster prefill, decode steps nearly flat in batch size), float32
    elsewhere."""
    if name == "auto":
        return "bfloat16" if fast_bf16() else "float32"
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be auto or one of {list(DTYPES)}, not {name!r}")
    return name


def load_runner(model: ModelConfig, worker: WorkerConfig) -> ModelRunner:
    dtype_name = model_dtype(model.dtype)
    pin_to(worker.cpus)
    set_threads(worker.threads or None)
    folder = resolve_model(model.name, model.cache_dir)
    # Found, or built if stale, before the worker registers: built inside its first decode
    # step, it would hold back heartbeats for ~30 s and the gateway would declare it dead.
    kernels()
    measured = MeasuredBlockRows(folder)
    rows = model.block_rows if model.block_rows >= 0 else measured.get(dtype_name)
    runner = ModelRunner(folder, worker.num_kv_blocks, worker.block_size, DTYPES[dtype_name],
                         rows)
    if rows is None:  # measured just now
        measured.put(dtype_name, runner.model.block_rows)
    return runner


class MeasuredBlockRows:
    """The block row counts measured on this machine, kept in the model folder by dtype and
    thread count (`block_rows.json`). Workers that start together and each time their own
    products do so against each other's memory traffic: they measured 0-4 rows where one
    alone measures 32. `engine.prepare`, which `launch.sh` runs first and alone, measures
    once for all of them."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "block_rows.json"

    def key(self, dtype_name: str) -> str:
        return f"{dtype_name}|threads={torch.get_num_threads()}|{machine_fingerprint()}"

    def get(self, dtype_name: str) -> int | None:
        value = self._known().get(self.key(dtype_name))
        return value if isinstance(value, int) and value >= 0 else None

    def put(self, dtype_name: str, rows: int) -> None:
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            partial.write_text(json.dumps({**self._known(), self.key(dtype_name): rows}, indent=1))
            partial.rename(self.path)
        except OSError as exc:  # a read-only model folder: every worker measures for itself
            log.warning("cannot keep the measured block rows in %s: %s", self.path, exc)

    def _known(self) -> dict[str, object]:
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or damaged: measured again
            return {}
        return known if isinstance(known, dict) else {}


def machine_fingerprint() -> str:
    """What the measurement depends on besides dtype and threads: CPU, torch and kernels."""
    cpu = platform.processor() + "|" + ",".join(sorted(cpu_flags()))
    text = f"{cpu}|{torch.__version__}|{kernels_digest()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kv_fingerprint(spec: ModelSpec, dtype: str) -> str:
    """What two workers must agree on to exchange KV (block size may differ: KV moves per token)."""
    return (f"{spec.name}|{dtype}|layers={spec.num_layers}|kv_heads={spec.num_kv_heads}"
            f"|head_dim={spec.head_dim}")


def worker_main(role: str, worker_class: type[Worker]) -> None:
    """The command line of a worker process (`python -m prefill`, `python -m decode`)."""
    parser = base_parser(f"raging {role} worker")
    parser.add_argument("--worker-id", default=f"{role}-0")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--cpus", help="pin to these CPUs, e.g. 1 or 0-1")
    args = parser.parse_args()
    config = config_from_args(args, {"threads": f"{role}.threads", "cpus": f"{role}.cpus"})
    setup_logging(args.worker_id)
    worker_config: WorkerConfig = getattr(config, role)
    runner = load_runner(config.model, worker_config)
    log.info("%s: products of up to %d rows read the weights' quantized blocks", args.worker_id,
             runner.model.block_rows)
    fingerprint = kv_fingerprint(runner.spec, model_dtype(config.model.dtype))
    worker = worker_class(args.worker_id, config, runner, fingerprint)  # type: ignore[call-arg]
    try:
        worker.run()
    except RegistrationRefused as exc:
        raise SystemExit(f"{args.worker_id}: the gateway refused this worker: {exc}") from None
    except TimeoutError as exc:
        raise SystemExit(f"{args.worker_id}: {exc} ({config.gateway.control_address})") from None
