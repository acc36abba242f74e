"""A model folder's record of the configs `python -m engine` has prepared it for on this
machine, read and written without torch.

`launch.sh` runs `python -m engine` before every start. Preparing (the kernels found or built,
the quant rows measured for each pool's thread count) imports torch and loads the model, ~2-3 s
even when nothing is left to do; once it has been done, the record says so in milliseconds.
An entry is keyed by everything that work depends on: the interpreter and its torch, this
CPU, the kernels' sources and compiler, the model's settings and threads, and the folder's
files as they are (the quant rows it keeps among them). Anything else, and it prepares again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from functools import cache
from pathlib import Path
from stat import S_ISREG

from core.config import Config
from core.cpus import pinned_cpus
from engine.kernels.cpu.sources import compiler, compiler_version, kernels_digest
from engine.kernels.isa import cpu_flags, resolve_isa
from engine.weights.files import PREPARED_FILE

# What preparing runs: a change to any of them (how the quant rows are measured or kept) prepares
# again, as a change to the kernels' sources does.
_PREPARING = ("__main__.py", "prepared.py", "runner.py", "weights/quant_rows.py",
              "model/linear.py")

MAX_ENTRIES = 64  # configs remembered per folder; the oldest go first


def thread_counts(config: Config) -> tuple[int, ...]:
    """The thread counts a worker of either pool may run with: its `threads`, or for 0 (one
    per CPU it is pinned to) one, as a worker pinned to a CPU of its own, or every CPU here,
    as one alone."""
    counts = {count for pool in (config.prefill, config.decode)
              for count in ((pool.threads,) if pool.threads else (1, len(pinned_cpus())))}
    return tuple(sorted(counts))


def preparation_key(config: Config, folder: Path) -> str | None:
    """What preparing `folder` for `config` depends on, as a digest; None where torch is not
    an installed distribution (nothing then is known without importing it)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = [sys.executable, torch_version, platform.processor(), *sorted(cpu_flags()),
             kernels_digest(), _preparing_digest(), compiler(), compiler_version(),
             os.environ.get("TORCH_EXTENSIONS_DIR", ""), repr(config.model),
             resolve_isa(config.engine.isa, cpu_flags()).name, repr(thread_counts(config)),
             str(folder.resolve()), *_files(folder)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def is_prepared(config: Config, folder: Path) -> bool:
    """Whether `folder` was prepared for `config` here, as it is now, and the kernels that
    preparing found are still where it found them."""
    key = preparation_key(config, folder)
    entry = _entries(folder).get(key) if key else None
    if not isinstance(entry, dict):
        return False
    kernels = entry.get("kernels")
    return kernels is None or (isinstance(kernels, str) and Path(kernels).is_file())


def record_prepared(config: Config, folder: Path, kernels: Path | None) -> None:
    """Note that `folder` is prepared for `config`, with the kernels' library at `kernels`
    (None: torch's own ops serve here). A folder that cannot be written to keeps no record:
    every start prepares, as before."""
    key = preparation_key(config, folder)
    if key is None:
        return
    entries = {name: value for name, value in _entries(folder).items() if name != key}
    kept = dict(list(entries.items())[-(MAX_ENTRIES - 1):])
    kept[key] = {"kernels": str(kernels) if kernels else None}
    partial = folder / f"{PREPARED_FILE}.{os.getpid()}.partial"
    try:
        partial.write_text(json.dumps(kept, indent=1))
        partial.rename(folder / PREPARED_FILE)
    except OSError:  # read-only, or the name taken by what is no file
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def _files(folder: Path) -> list[str]:
    """Each file of `folder` but the record and files half written, with its size and
    modification time."""
    lines = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(PREPARED_FILE) or path.name.endswith(".partial"):
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:  # renamed or removed by another process meanwhile
            continue
        if S_ISREG(stat.st_mode):
            lines.append(f"{path.name}|{stat.st_size}|{stat.st_mtime_ns}")
    return lines


@cache
def _preparing_digest() -> str:
    engine = Path(__file__).parent
    return hashlib.sha256(b"".join((engine / name).read_bytes()
                                   for name in _PREPARING)).hexdigest()[:16]


def _entries(folder: Path) -> dict[str, object]:
    try:
        entries = json.loads((folder / PREPARED_FILE).read_text())
    except (OSError, ValueError):  # none yet, or damaged: prepared again
        return {}
    return entries if isinstance(entries, dict) else {}
