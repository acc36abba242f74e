"""Percentiles, TPOT, SLO attainment, goodput rate and run summaries on hand-made samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.client import RequestResult
from bench.load import LoadRun
from bench.stats import (
    Distribution,
    Goodput,
    Slo,
    attainment,
    goodput,
    goodput_rate,
    inter_token_gaps,
    percentile,
    tpot,
)
from bench.summary import error_kind, summarize


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5, 1, 4, 2, 3], list(range(101)),
                                    [0.2, 0.9, 0.1, 7.5, 3.3, 3.3, 0.0]])
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_by_hand_and_edges() -> None:
    assert percentile([10, 20, 30, 40], 50) == 25
    assert percentile([10, 20, 30, 40], 90) == pytest.approx(37)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution() -> None:
    summary = Distribution.of([4.0, 1.0, 3.0, 2.0])
    assert (summary.count, summary.mean, summary.p50) == (4, 2.5, 2.5)
    assert summary.p90 == pytest.approx(3.7) and summary.p99 == pytest.approx(3.97)
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.p99)


def test_tpot_and_gaps() -> None:
    assert tpot(e2e_s=1.0, ttft_s=0.1, output_tokens=10) == pytest.approx(0.1)
    assert tpot(e2e_s=1.0, ttft_s=0.4, output_tokens=2) == pytest.approx(0.6)
    assert tpot(1.0, 0.1, 1) is None and tpot(1.0, 0.1, 0) is None
    assert inter_token_gaps([0.5, 0.6, 0.9]) == pytest.approx([0.1, 0.3])
    assert inter_token_gaps([0.5]) == []


def test_slo_attainment() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert slo.met(1.0, 0.1) and slo.met(0.5, None)
    assert not slo.met(1.01, 0.05) and not slo.met(0.5, 0.11) and not slo.met(None, None)
    samples = [(0.5, 0.05), (2.0, 0.05), (0.5, 0.2), (None, None), (0.9, None)]
    assert attainment(slo, samples) == pytest.approx(2 / 5)
    assert math.isnan(attainment(slo, []))


def test_goodput_rate() -> None:
    assert goodput_rate([(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5)]) == 4
    assert goodput_rate([(8, 0.5), (1, 1.0), (2, 0.95)]) == 2  # order does not matter
    assert goodput_rate([(1, 1.0), (2, 0.8), (4, 0.95)]) == 1  # a lucky high rate does not count
    assert goodput_rate([(1, 0.89)]) is None
    assert goodput_rate([(1, 1.0), (2, math.nan)]) == 1
    assert goodput_rate([(1, 0.8), (2, 0.8)], target=0.75) == 2


def test_slo_with_a_ttft_budget_curve_over_prompt_length() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1, ttft_curve=((100, 1.1), (1100, 2.1), (2100, 3.1)))
    assert slo.ttft_budget(3000) == pytest.approx(4.0) and slo.ttft_budget(None) == 1.0
    assert slo.ttft_budget(600) == pytest.approx(1.6)  # between points: linear
    assert slo.ttft_budget(10) == pytest.approx(1.1)  # below the first: flat
    assert slo.scaled(2).ttft_budget(600) == pytest.approx(3.2) and slo.scaled(2).tpot_s == 0.2
    assert slo.met(3.9, 0.1, 3000) and not slo.met(3.9, 0.1, 2000)
    assert not slo.met(1.5, 0.05) and not slo.met(0.5, 0.2, 3000)
    samples = [(3.9, 0.05, 3000), (3.9, 0.05, 100), (0.5, None, 10), (None, None, 10)]
    assert attainment(slo, samples) == pytest.approx(2 / 4)


def test_goodput_interpolates_where_attainment_crosses_the_target() -> None:
    # kept 1.0 at 1 req/s, 0.8 at 2 req/s: 0.9 is crossed half-way
    assert goodput([(1, 1.0), (2, 0.8), (4, 0.1)]) == Goodput(1.5)
    assert goodput([(2, 0.95), (1, 1.0), (3, 0.7)]).rate == pytest.approx(2.2)  # any order
    assert goodput([(1, 1.0), (2, 0.9), (3, 0.9)]) == Goodput(3, censored=True)
    assert goodput([(1, 0.5), (2, 1.0)]) == Goodput(None)  # the lowest rate already misses
    assert goodput([(1, 1.0), (2, 0.5), (3, 1.0)]).rate == pytest.approx(1.2)  # lucky 3 ignored
    assert goodput([(1, 1.0), (2, math.nan)]) == Goodput(1)
    assert goodput([]) == Goodput(None)
    assert [g.describe() for g in (Goodput(1.5), Goodput(3, True), Goodput(None))] == \
        ["1.50", ">= 3", "none"]


def _ok(index: int, ttft: float, e2e: float, tokens: int) -> RequestResult:
    times = tuple(ttft + (e2e - ttft) * i / max(1, tokens - 1) for i in range(tokens))
    return RequestResult(index, "fixed", 0.0, 10, tokens, ttft_s=ttft, e2e_s=e2e,
                         chunk_times_s=times, prompt_tokens=10, output_tokens=tokens)


def test_summarize_a_hand_made_run() -> None:
    results = (
        _ok(0, ttft=0.5, e2e=1.4, tokens=10),  # tpot 0.1: good
        _ok(1, ttft=1.5, e2e=2.4, tokens=10),  # ttft over the SLO
        _ok(2, ttft=0.2, e2e=0.2, tokens=1),  # one token: judged on ttft alone
        RequestResult(3, "fixed", 0.0, 10, 10, error="HTTP 503: busy"),
        RequestResult(4, "fixed", 0.0, 10, 10, error="timeout after 5s"),
    )
    summary = summarize(LoadRun(results, duration_s=2.0, unsent=1), Slo(1.0, 0.1))
    assert (summary.completed, summary.failed, summary.unsent) == (3, 2, 1)
    assert summary.output_tokens == 21 and summary.output_tokens_per_s == pytest.approx(10.5)
    assert summary.input_tokens == 30 and summary.requests_per_s == pytest.approx(1.5)
    assert summary.ttft_s.count == 3 and summary.ttft_s.p50 == pytest.approx(0.5)
    assert summary.tpot_s.count == 2 and summary.tpot_s.mean == pytest.approx(0.1)
    assert summary.itl_s.count == 18 and summary.itl_s.p50 == pytest.approx(0.1)
    assert summary.e2e_s.p50 == pytest.approx(1.4)
    assert summary.slo_attainment == pytest.approx(2 / 5)
    assert summary.goodput_requests_per_s == pytest.approx(1.0)
    assert summary.errors == {"HTTP 503": 1, "timeout after 5s": 1}
    assert error_kind("ReadError: connection reset") == "ReadError"
