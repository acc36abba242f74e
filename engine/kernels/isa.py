"""What this CPU reports it can do (its `/proc/cpuinfo` flags), read without torch, and the
instruction-set levels the C++ kernels are built for: each level is a separate build, chosen at
run time from the flags of the CPU that runs it, never from the host that built it.

The gateway resolves `model.dtype: auto` with these flags too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: the CPU flags it needs and the compiler flags it is built with
    (each level includes the ones before it)."""

    name: str
    needs: frozenset[str]
    cflags: tuple[str, ...]

    def runs_on(self, flags: frozenset[str]) -> bool:
        return self.needs <= flags


def _levels() -> tuple[IsaLevel, ...]:
    steps = (
        ("generic", (), ()),
        ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
        ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
         ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
        ("avx512_bf16", ("avx512_bf16", "avx512_vnni"), ("-mavx512bf16", "-mavx512vnni")),
        ("amx", ("amx_tile", "amx_bf16"), ("-mamx-tile", "-mamx-bf16")),
    )
    levels: list[IsaLevel] = []
    needs: frozenset[str] = frozenset()
    cflags: tuple[str, ...] = ()
    for name, more_needs, more_cflags in steps:
        needs, cflags = needs | set(more_needs), cflags + more_cflags
        levels.append(IsaLevel(name, needs, cflags))
    return tuple(levels)


LEVELS = _levels()
ISA_NAMES = tuple(level.name for level in LEVELS)
ISA_FLAGS = LEVELS[-1].needs  # every flag a level looks at


@cache
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's flags in `cpuinfo` (none if it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


@cache
def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The first CPU's model name ("" if it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), "")


def cpu_summary() -> str:
    """This CPU as benchmarks record it: its name, the CPUs this process may use, and its
    instruction-set flags."""
    flags = " ".join(sorted(cpu_flags() & ISA_FLAGS))
    return f"{cpu_name() or 'unknown CPU'}, {len(os.sched_getaffinity(0))} CPUs ({flags})"


def native_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (else bf16 is emulated, and slow)."""
    return not BF16_FLAGS.isdisjoint(cpu_flags(cpuinfo))


def runnable_levels(flags: frozenset[str]) -> tuple[IsaLevel, ...]:
    """Every level a CPU with `flags` can run, the portable one first."""
    return tuple(level for level in LEVELS if level.runs_on(flags))


def resolve_isa(name: str, flags: frozenset[str]) -> IsaLevel:
    """The level `name` asks for ("auto": the highest this CPU runs); ValueError when the CPU
    lacks what it needs or the name is unknown."""
    if name == "auto":
        return runnable_levels(flags)[-1]
    level = next((level for level in LEVELS if level.name == name), None)
    if level is None:
        raise ValueError(f"engine.isa must be auto or one of {', '.join(ISA_NAMES)}, "
                         f"not {name!r}")
    if not level.runs_on(flags):
        missing = ", ".join(sorted(level.needs - flags))
        raise ValueError(f"engine.isa={name}: this CPU lacks {missing}")
    return level
