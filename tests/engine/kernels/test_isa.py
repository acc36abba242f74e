"""Instruction-set levels: which a CPU runs, which `engine.isa` picks, and what a forced level
this CPU lacks gets."""

from __future__ import annotations

import itertools
import os
import typing
from pathlib import Path

import pytest

from core.config import KernelIsa, load_config
from engine.kernels.isa import (
    ISA_NAMES,
    LEVELS,
    cpu_flags,
    cpu_name,
    cpu_summary,
    resolve_isa,
    runnable_levels,
)

AVX2_ONLY = frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c"})
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16 = AVX512_NO_BF16 | {"avx512_bf16", "avx512_vnni"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


def test_each_level_needs_and_builds_with_what_the_one_before_does() -> None:
    for before, after in itertools.pairwise(LEVELS):
        assert before.needs < after.needs
        assert after.cflags[:len(before.cflags)] == before.cflags
    assert "-march=native" not in {flag for level in LEVELS for flag in level.cflags}


@pytest.mark.parametrize(("flags", "best"), [
    (frozenset(), "generic"), (frozenset({"sse2", "avx"}), "generic"),
    (frozenset({"avx2", "fma"}), "generic"),  # no f16c: the quant blocks' scales need it
    (AVX2_ONLY, "avx2"), (AVX512_NO_BF16, "avx512"), (AVX512_BF16, "avx512_bf16"), (AMX, "amx"),
])
def test_auto_picks_the_highest_level_the_cpu_runs(flags: frozenset[str], best: str) -> None:
    assert resolve_isa("auto", flags).name == best
    assert runnable_levels(flags)[0].name == "generic"


def test_a_lower_level_can_be_forced_on_a_higher_cpu() -> None:
    assert resolve_isa("avx2", AMX).name == "avx2"
    assert resolve_isa("generic", AVX2_ONLY).name == "generic"


def test_a_level_the_cpu_lacks_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(ValueError, match="lacks avx512_bf16, avx512_vnni"):
        resolve_isa("avx512_bf16", AVX512_NO_BF16)
    with pytest.raises(ValueError, match="auto or one of generic, avx2"):
        resolve_isa("sse9", AMX)


def test_the_config_setting_offers_every_level() -> None:
    assert typing.get_args(KernelIsa) == ("auto", *ISA_NAMES)
    assert load_config(None, {"engine.isa": "avx2"}).engine.isa == "avx2"
    with pytest.raises(ValueError):
        load_config(None, {"engine.isa": "neon"})


def test_the_cpu_name_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n")
    assert cpu_name(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_name(tmp_path / "missing") == ""


def test_the_cpu_summary_names_the_cpu_its_count_and_its_isa_flags() -> None:
    summary = cpu_summary()
    assert summary.startswith(cpu_name() or "unknown CPU")
    assert f"{len(os.sched_getaffinity(0))} CPUs" in summary
    assert ("avx2" in summary) == ("avx2" in cpu_flags())
