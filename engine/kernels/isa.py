"""What this CPU reports it can do (its `/proc/cpuinfo` flags), read without torch: the gateway
resolves `model.dtype: auto` with it too."""

from __future__ import annotations

from functools import cache
from pathlib import Path

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's flags in `cpuinfo` (none if it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (else bf16 is emulated, and slow)."""
    return not BF16_FLAGS.isdisjoint(cpu_flags(cpuinfo))
