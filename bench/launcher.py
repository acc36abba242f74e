"""Our server for a benchmark: scripts/launch.sh in a temporary run folder, stopped by PID.

While it runs, `memory()` reads the resident (RSS), proportional (PSS) and peak resident memory
of every process launch.sh started, from the run folder's `pids` file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from core.config import Config, load_config
from core.pids import started_pids
from engine.locate import resolve_model

ROOT = Path(__file__).resolve().parents[1]
READY = "[launch] ready"
_KEY_IN_WORD = re.compile(r"(--api-key(?:=|\s+))\S+")
MB = 2**20
# launch.sh flags that turn conditional disaggregation off: every prompt goes to a prefill worker
PURE_DISAGG = ("--set", "gateway.local_prefill_max_tokens=0",
               "--set", "gateway.prefill_saturated_tokens=0")


@dataclass(frozen=True)
class LaunchedServer:
    """A running server that launch.sh started, and where it keeps its logs and PIDs."""

    url: str
    run_dir: Path
    launcher: subprocess.Popen[bytes]


@dataclass(frozen=True)
class ProcessMemory:
    """Memory of one process, in MiB."""

    rss_mb: float
    pss_mb: float
    peak_rss_mb: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _flag_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--model", "--config", "--port", "--host", "--run-dir"):
        parser.add_argument(flag)
    return parser


def model_dir(flags: Sequence[str]) -> Path:
    """The model folder a launch with `flags` serves (its --model, else its config's model)."""
    known, _ = _flag_parser().parse_known_args(list(flags))
    config = load_config(known.config) if known.config else Config()
    return resolve_model(known.model or config.model.name, config.model.cache_dir)


def redact(words: Sequence[str]) -> tuple[str, ...]:
    """A command line with the value of every --api-key hidden, fit to print or record (also
    inside one word, such as a bench `--launch "FLAGS"`)."""
    return tuple("***" if previous == "--api-key" else _KEY_IN_WORD.sub(r"\1***", word)
                 for previous, word in zip(["", *words], words, strict=False))


@contextmanager
def launched(flags: Sequence[str], timeout_s: float = 600,
             api_key: str | None = None) -> Iterator[LaunchedServer]:
    """Run launch.sh with `flags` (and `api_key` as one of its keys) until ready; stop
    everything it started afterwards."""
    known, _ = _flag_parser().parse_known_args(list(flags))
    if known.run_dir:
        raise ValueError("--run-dir is chosen by the benchmark; leave it out of --launch")
    run_dir = Path(tempfile.mkdtemp(prefix="raging-bench-"))
    port = int(known.port) if known.port else free_port()
    command = [str(ROOT / "scripts/launch.sh"), *flags, "--run-dir", str(run_dir)]
    command += [] if known.port else ["--port", str(port)]
    command += ["--api-key", api_key] if api_key else []
    print(f"[bench] launching: {' '.join(redact(command))}", file=sys.stderr)
    with (run_dir / "launch.log").open("wb") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_ready(launcher, run_dir, timeout_s)
            host = known.host or "127.0.0.1"
            yield LaunchedServer(f"http://{host}:{port}", run_dir, launcher)
        finally:
            stop(launcher, run_dir)


def wait_ready(launcher: subprocess.Popen[bytes], run_dir: Path, timeout_s: float) -> None:
    log = run_dir / "launch.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if READY in log.read_text(errors="replace"):
            return
        if launcher.poll() is not None:
            raise RuntimeError(f"launch.sh exited ({launcher.returncode}); its log ends:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"server not ready in {timeout_s:g}s; see {log}")


def stop(launcher: subprocess.Popen[bytes], run_dir: Path,
         signum: int = signal.SIGTERM) -> None:
    """SIGTERM launch.sh (it stops its children; joined workers drain first, SIGINT stops
    them at once), then SIGKILL whatever is left, by PID."""
    if launcher.poll() is None:
        launcher.send_signal(signum)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait(timeout=10)
    for pid in started_pids(run_dir).values():
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                os.kill(pid, signal.SIGKILL)


def memory(run_dir: Path) -> dict[str, ProcessMemory]:
    """RSS, PSS and peak RSS of every live process launch.sh started in `run_dir`."""
    return processes_memory(started_pids(run_dir))


def processes_memory(pids: dict[str, int]) -> dict[str, ProcessMemory]:
    """RSS, PSS and peak RSS of each live process of `pids` (name -> PID)."""
    table = {}
    for name, pid in pids.items():
        try:
            process = psutil.Process(pid)
            info = process.memory_full_info()
            peak = _peak_rss(pid)
        except (psutil.Error, OSError):
            continue  # it exited meanwhile: nothing to measure
        table[name] = ProcessMemory(info.rss / MB, info.pss / MB, peak / MB)
    return table


def _peak_rss(pid: int) -> int:
    """Bytes of the process's peak resident set (VmHWM in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
