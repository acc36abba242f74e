"""The prefill attention benchmark, run for real on small caches."""

from __future__ import annotations

import pytest

from bench.prefill_attention import markdown, measure, parse_chunk


def test_chunk_specs_parse() -> None:
    assert parse_chunk("256@2816") == (256, 2816)
    assert parse_chunk("37") == (37, 0)
    for bad in ("", "0@5", "abc", "16@-1", "16@x"):
        with pytest.raises(ValueError):
            parse_chunk(bad)


@pytest.mark.kernels
def test_both_paths_agree_and_are_timed() -> None:
    figures = measure(["16@0", "5@40"], repeats=2, cache_blocks=64, layers=2)
    assert [f.chunk for f in figures] == ["16@0", "5@40"]
    for figure in figures:
        assert figure.kernel_ms > 0 and figure.gathered_ms > 0 and figure.speedup > 0
    assert figures[1].gflop == (5 * 40 + 15) * 9 * 64 * 4 * 2 / 1e9
    assert markdown(figures).count("\n") == 3


def test_chunks_beyond_the_cache_are_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        measure(["16@64"], repeats=1, cache_blocks=4, layers=1)
