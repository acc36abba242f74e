"""The C++ kernels' sources and the compiler that builds them: what a build depends on, known
without importing torch (`python -m engine` checks a prepared model with them alone)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from functools import cache
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("module.cpp", "quant_linear.cpp", "quant_int8.cpp", "paged_decode.cpp",
           "paged_prefill.cpp", "pointwise.cpp")
HEADERS = ("lanes.h", "quant_format.h", "tensor.h")


@cache
def kernels_digest() -> str:
    """A digest of every kernel source and header: it changes whenever the kernels may."""
    return hashlib.sha256(b"".join((CSRC / name).read_bytes()
                                   for name in (*SOURCES, *HEADERS))).hexdigest()[:16]


def compiler() -> str:
    """The C++ compiler torch builds extensions with."""
    return os.environ.get("CXX", "c++")


@cache
def compiler_version() -> str:
    """The compiler's first `--version` line ("unknown" where it cannot say)."""
    try:
        return subprocess.run([compiler(), "--version"], capture_output=True, text=True,
                              check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"
