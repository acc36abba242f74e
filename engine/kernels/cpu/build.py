"""Building raging's C++ CPU kernels (csrc/): decode and prefill attention over the paged cache,
products over the weights' quant blocks, RMSNorm, RoPE.

They are compiled once per machine with the system C++ compiler (about 30 s, cached under
~/.cache/torch_extensions). Where that fails, every caller falls back to torch's own ops, and
`build_problem` says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import get_default_build_root, load

log = logging.getLogger(__name__)
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name
            for name in ("module.cpp", "quant_linear.cpp", "paged_decode.cpp", "paged_prefill.cpp",
                         "pointwise.cpp")]
_HEADERS = [_CSRC / "lanes.h"]
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what every kernel reads and writes


def kernels() -> ModuleType | None:
    """The compiled module, or None (logged once) when it cannot be built here."""
    return _built()[0]


def build_problem() -> str | None:
    """Why `kernels()` is None here (None when they built)."""
    return _built()[1]


@cache
def _built() -> tuple[ModuleType | None, str | None]:
    try:
        return _build(), None
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        log.warning("C++ kernels unavailable, using torch ops: %s", exc)
        return None, str(exc)


def has_compiler() -> bool:
    """Whether the C++ compiler torch builds extensions with is on this machine."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _build() -> ModuleType:
    # torch's get_default_build_root ignores TORCH_EXTENSIONS_DIR, which its builds honour:
    # without it, checkouts with other source paths would rebuild over each other.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    folder = Path(root) / f"raging_kernels-torch{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder / "raging.flock"):
        # torch's own lock file outlives a build that was killed, and then every later
        # build waits on it forever; holding our lock, no build of ours is running.
        (folder / "lock").unlink(missing_ok=True)
        return load(name="raging_kernels", sources=[str(s) for s in _SOURCES],
                    extra_cflags=[*_FLAGS, _headers_digest()], extra_ldflags=["-fopenmp"],
                    build_directory=str(folder))


def _headers_digest() -> str:
    """A define that changes with the headers: torch rebuilds when sources or flags change, and
    does not look at the headers the sources include."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in _HEADERS)).hexdigest()[:16]
    return f"-DRAGING_HEADERS_{digest}"


@cache
def kernels_digest() -> str:
    """A digest of every kernel source and header: it changes whenever the kernels may."""
    return hashlib.sha256(b"".join(path.read_bytes()
                                   for path in (*_SOURCES, *_HEADERS))).hexdigest()[:16]


def kernels_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The module if it reads `tensors` (all fp32 or all bf16, on the CPU), else None."""
    first = tensors[0]
    if first.dtype not in KERNEL_DTYPES or first.device.type != "cpu":
        return None
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
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
