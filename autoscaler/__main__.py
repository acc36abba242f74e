"""`python -m autoscaler --url URL --control ADDR --keys DIR --bounds MIN:MAX --base P:D ...`:
the pools of one host sized by the gateway's wishes (autoscaler/pools.py), read every
`autoscale.poll_s`. launch.sh --autoscale starts it; arguments after `--` (the cluster's
--config and --set among them) go to each worker's launch.sh --join."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from autoscaler.pools import Bounds, LaunchedWorkers, PoolScaler, join_command, run
from core.cli import ConfigParser
from core.config import Config, Role
from core.logs import setup_logging
from gateway.auth import KeysError, parse_key_spec, read_keys_file

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("autoscaler")


def main(argv: list[str]) -> int:
    args, extra = _parser().parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    setup_logging("autoscaler", "text")
    try:
        bounds = Bounds.parse(args.bounds)
        key = _api_key(args.api_key, args.api_key_file)
    except (ValueError, KeysError) as exc:
        print(f"autoscaler: {exc}", file=sys.stderr)
        return 2
    poll_s = _cluster_config(extra).autoscale.poll_s
    prefill, decode = (int(n) for n in args.base.split(":"))
    run_dir = Path(args.run_dir)

    def start(role: Role, number: int) -> subprocess.Popen[bytes]:
        folder = run_dir / f"scaled-{role}-{number}"
        folder.mkdir(parents=True, exist_ok=True)
        command = join_command(ROOT / "scripts/launch.sh", args.control, args.keys, role,
                               folder, extra)
        with (folder / "launch.log").open("wb") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    launched = LaunchedWorkers(run_dir)
    scaler = PoolScaler(bounds, {"prefill": prefill, "decode": decode}, start,
                        lambda role: launched.count(role, time.monotonic()))
    log.info("sizing the pools between %d and %d workers from %s, every %g s", bounds.least,
             bounds.most, args.url, poll_s)
    run(scaler, lambda: _metrics(args.url, key), poll_s, lambda: stop["now"])
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autoscaler")
    parser.add_argument("--url", required=True, help="the gateway's base URL")
    parser.add_argument("--control", required=True, help="its control address, for --join")
    parser.add_argument("--keys", required=True, help="the cluster's CURVE keys folder")
    parser.add_argument("--bounds", required=True, help="MIN:MAX workers a pool")
    parser.add_argument("--base", required=True, help="PREFILL:DECODE workers launch.sh runs")
    parser.add_argument("--run-dir", required=True, help="where each started worker logs")
    parser.add_argument("--api-key", action="append", default=[])
    parser.add_argument("--api-key-file", default="")
    return parser


def _cluster_config(join_args: list[str]) -> Config:
    """The config the workers it starts are given (their --config and --set)."""
    parser = ConfigParser("python -m autoscaler", "the cluster's config")
    known, _ = parser.parse_known_args(join_args)
    return parser.config(known)


def _api_key(specs: list[str], path: str) -> str | None:
    """A key the gateway accepts, to read /metrics with (None when it takes none)."""
    if specs:
        return parse_key_spec(specs[0], "--api-key")[0]
    if path:
        keys = read_keys_file(Path(path))
        return keys[0][0] if keys else None
    return None


def _metrics(url: str, key: str | None) -> str:
    request = urllib.request.Request(url.rstrip("/") + "/metrics")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return str(response.read().decode())


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
