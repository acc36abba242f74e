"""The decode attention benchmark, run for real on small caches."""

from __future__ import annotations

import pytest
import torch

from bench.attention import markdown, measure, parse_contexts


def test_context_specs_expand_to_lengths() -> None:
    assert parse_contexts("256x3+3400") == [256, 256, 256, 3400]
    assert parse_contexts("17") == [17]
    for bad in ("", "0x2", "abc", "16x"):
        with pytest.raises(ValueError):
            parse_contexts(bad)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_paths_agree_and_are_timed(dtype: torch.dtype) -> None:
    figures = measure(["16x2+40", "5"], dtype, repeats=2, cache_blocks=64, layers=2)
    assert [f.contexts for f in figures] == ["16x2+40", "5"]
    for figure in figures:
        assert figure.kernel_ms > 0 and figure.gathered_ms > 0 and figure.speedup > 0
    element = 4 if dtype == torch.float32 else 2
    assert figures[1].kv_megabytes == 5 * 2 * 3 * 64 * element * 2 / 2**20
    assert markdown(figures).count("\n") == 3


def test_contexts_beyond_the_cache_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        measure(["16x5"], torch.float32, repeats=1, cache_blocks=4, layers=1)
