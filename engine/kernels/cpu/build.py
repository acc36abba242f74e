"""Building raging's C++ CPU kernels (csrc/): decode and prefill attention over the paged cache,
products over the weights' quant blocks, RMSNorm, RoPE.

The same sources are built once per instruction-set level (engine.kernels.isa: generic, avx2,
avx512, avx512_bf16, amx), each with that level's compiler flags and never `-march=native`, so
a build made on one CPU cannot run an instruction another lacks. A process uses one level:
the highest its CPU runs, or the one `engine.isa` names (`use_isa`). Each build lives in a
folder named by the level and a digest of the sources, compiler, torch (where it is installed
too), Python and flags, so checkouts, virtual environments, CPUs and compilers never rebuild
over each other (about 30-60 s each, under
~/.cache/torch_extensions or TORCH_EXTENSIONS_DIR). Where a build fails, every caller falls
back to torch's own ops, and `build_problem` says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import get_default_build_root, include_paths, library_paths, load

from engine.kernels.cpu.sources import (
    CSRC,
    HEADERS,
    SOURCES,
    compiler,
    compiler_version,
    kernels_digest,
)
from engine.kernels.isa import IsaLevel, cpu_flags, resolve_isa

log = logging.getLogger(__name__)
_FLAGS = ("-O3", "-ffast-math", "-fopenmp")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what every kernel reads and writes

_selected: IsaLevel | None = None


def use_isa(name: str) -> IsaLevel:
    """Make `name` ("auto" or a level of engine.kernels.isa) the level this process's kernels
    are built for and run at; ValueError where this CPU cannot run it."""
    global _selected
    _selected = resolve_isa(name, cpu_flags())
    return _selected


def chosen_isa() -> IsaLevel:
    """The level this process runs its kernels at."""
    return _selected or _auto_isa()


@cache
def _auto_isa() -> IsaLevel:
    return resolve_isa("auto", cpu_flags())


def kernels() -> ModuleType | None:
    """The compiled module at the chosen level, or None (logged once) where it cannot be
    built here. Every kernel call asks, so it is a lookup (under a microsecond)."""
    return kernels_at(chosen_isa())[0]


def running_isa() -> str:
    """The level the kernels run at here, or "torch" where none could be built."""
    return chosen_isa().name if kernels() is not None else "torch"


def build_problem() -> str | None:
    """Why `kernels()` is None here (None when they built)."""
    return kernels_at(chosen_isa())[1]


@cache
def kernels_at(level: IsaLevel) -> tuple[ModuleType | None, str | None]:
    """The module built for `level` and None, or None and why it could not be built."""
    try:
        return _build(level), None
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        log.warning("C++ kernels (%s) unavailable, using torch ops: %s", level.name, exc)
        return None, str(exc)


def has_compiler() -> bool:
    """Whether the C++ compiler torch builds extensions with is on this machine."""
    return shutil.which(compiler()) is not None


def _build(level: IsaLevel) -> ModuleType:
    # torch's get_default_build_root ignores TORCH_EXTENSIONS_DIR, which its builds honour.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    flags = [*_FLAGS, *level.cflags]
    folder = Path(root) / f"raging_kernels-{level.name}-{build_digest(flags)}"
    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder / "raging.flock"):
        # torch's own lock file outlives a build that was killed, and then every later
        # build waits on it forever; holding our lock, no build of ours is running.
        (folder / "lock").unlink(missing_ok=True)
        sources = _copy_sources(folder / "src")
        return load(name=f"raging_kernels_{level.name}", sources=[str(s) for s in sources],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(folder))


def _copy_sources(into: Path) -> list[Path]:
    """The sources copied into the build folder: ninja's commands name them, so every checkout
    builds from the same paths and finds the others' build up to date."""
    into.mkdir(exist_ok=True)
    for name in (*SOURCES, *HEADERS):
        text = (CSRC / name).read_bytes()
        target = into / name
        if not target.exists() or target.read_bytes() != text:
            target.write_bytes(text)
    return [into / name for name in SOURCES]



def build_digest(flags: list[str]) -> str:
    """What a build depends on: the sources, the compiler, torch (its version, and where its
    headers and libraries are: a build's commands name them, and two virtual environments
    sharing one folder would each find the other's build stale), Python's headers and the
    flags."""
    text = "|".join((kernels_digest(), compiler_version(), torch.__version__, *include_paths(),
                     *library_paths(), sysconfig.get_paths()["include"], *flags))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kernels_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The module if it reads `tensors` (all fp32 or all bf16, on the CPU), else None."""
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES:
        return None
    for tensor in tensors:  # a loop, not any(): every kernel call asks
        if tensor.dtype is not dtype or not tensor.is_cpu:
            return None
    return kernels()


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, released by the kernel when its holder dies."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
