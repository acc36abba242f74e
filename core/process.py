"""A worker process from its command line to its last heartbeat: flags, logging, CPU pinning,
then the worker each role builds (`python -m prefill`, `python -m decode`) and its loop."""

from __future__ import annotations

import gc
from collections.abc import Callable

from core.cli import ConfigParser
from core.config import Config, Role
from core.cpus import pin_to
from core.logs import setup_logging
from core.worker import RegistrationRefused, Worker

Build = Callable[[str, Config], Worker]  # (worker id, config) -> the worker, model loaded


def worker_main(role: Role, build: Build) -> None:
    """Parse the command line, pin this process to its CPUs, build the worker (loading its
    model there, pinned) and serve until SIGTERM or SIGINT."""
    parser = ConfigParser(f"python -m {role}", f"raging {role} worker")
    parser.add_argument("--worker-id", default=f"{role}-0",
                        help="its name at the gateway (default: %(default)s)")
    parser.config_flag(f"{role}.threads")
    parser.config_flag(f"{role}.cpus")
    args = parser.parse_args()
    config = parser.config(args)
    setup_logging(args.worker_id, config.logging.format)
    try:
        pin_to(config.pool(role).cpus)
    except ValueError as exc:  # a CPU list that is malformed or not this machine's
        raise SystemExit(f"{args.worker_id}: {exc}") from None
    worker = build(args.worker_id, config)
    freeze_start_up()
    try:
        worker.run()
    except RegistrationRefused as exc:
        raise SystemExit(f"{args.worker_id}: the gateway refused this worker: {exc}") from None
    except TimeoutError as exc:
        raise SystemExit(f"{args.worker_id}: {exc} ({config.gateway.control_address})") from None


def freeze_start_up() -> None:
    """Collect what start-up left as garbage, then freeze the rest: what a process built to
    serve (torch's, the tokenizer's, the model's objects) lives as long as it does, and no
    collection walks it again, while serving nor at exit (a worker's last one took ~1.5 s)."""
    gc.collect()
    gc.freeze()
