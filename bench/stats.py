"""Percentiles, per-request latencies and SLO goodput over the results of a benchmark run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

QUANTILES = (50, 90, 99)
GOODPUT_TARGET = 0.9  # a rate "keeps" the SLO when at least this share of requests meets it


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Mean and p50/p90/p99 of one latency measure (seconds), over `count` samples."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """The summary of `values` (NaN everywhere when there are none)."""
        mean = sum(values) / len(values) if values else math.nan
        p50, p90, p99 = (percentile(values, q) for q in QUANTILES)
        return cls(len(values), mean, p50, p90, p99)


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1); None below 2 tokens."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def inter_token_gaps(arrivals: Sequence[float]) -> list[float]:
    """Every gap between consecutive content-chunk arrival times."""
    return [later - earlier for earlier, later in pairwise(arrivals)]


@dataclass(frozen=True)
class Slo:
    """Latency objectives: a request is good when TTFT <= its TTFT budget and TPOT <= tpot_s.

    The TTFT budget is `ttft_s`, or, given `ttft_curve` ((prompt tokens, budget) points in
    ascending length), the curve at the prompt's length: a long prompt may take longer to its
    first token, as it does on an idle server. Between points the curve is linear; below the
    first it stays at the first point's budget, beyond the last it follows the last segment.
    """

    ttft_s: float
    tpot_s: float
    ttft_curve: tuple[tuple[int, float], ...] = ()

    def ttft_budget(self, prompt_tokens: int | None = None) -> float:
        """The TTFT objective of a request with `prompt_tokens` (None: unknown, `ttft_s`)."""
        if not self.ttft_curve or prompt_tokens is None:
            return self.ttft_s
        return along(self.ttft_curve, prompt_tokens)

    def scaled(self, factor: float) -> Slo:
        """Every objective times `factor`."""
        return Slo(factor * self.ttft_s, factor * self.tpot_s,
                   tuple((n, factor * budget) for n, budget in self.ttft_curve))

    def met(self, ttft_s: float | None, tpot_s: float | None,
            prompt_tokens: int | None = None) -> bool:
        """Whether one request met both objectives (failed requests have ttft None: never).

        A one-token answer has no TPOT; it is judged on its TTFT alone.
        """
        if ttft_s is None or ttft_s > self.ttft_budget(prompt_tokens):
            return False
        return tpot_s is None or tpot_s <= self.tpot_s


def along(points: Sequence[tuple[int, float]], x: float) -> float:
    """The piecewise-linear curve through `points` (ascending x) at `x`: the first point's y
    below them, the last segment extended beyond them."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    segments = list(pairwise(points))
    (x0, y0), (x1, y1) = next((s for s in segments if x <= s[1][0]), segments[-1])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# (ttft, tpot) or (ttft, tpot, prompt tokens) of one request; a failure has ttft None
Sample = tuple[float | None, float | None] | tuple[float | None, float | None, int | None]


def attainment(slo: Slo, samples: Sequence[Sample]) -> float:
    """Share of requests in SLO, given as `Sample`s (failures as (None, None)); NaN if none."""
    if not samples:
        return math.nan
    return sum(slo.met(*sample) for sample in samples) / len(samples)


def goodput_rate(points: Sequence[tuple[float, float]],
                 target: float = GOODPUT_TARGET) -> float | None:
    """Highest request rate of a sweep that keeps SLO attainment >= target.

    `points` are (rate, attainment). A rate counts only when it and every lower rate measured
    meet the target, so a lucky high rate after a failing lower one does not. None when even
    the lowest rate misses.
    """
    best = None
    for rate, share in sorted(points):
        if not share >= target:  # NaN (no requests) misses too
            break
        best = rate
    return best


@dataclass(frozen=True)
class Goodput:
    """The goodput of a sweep: where SLO attainment crosses the target, between swept rates.

    `rate` None: even the lowest rate missed. `censored`: every swept rate kept the target, so
    the goodput is at least `rate` (the highest one), not exactly it.
    """

    rate: float | None
    censored: bool = False

    def describe(self) -> str:
        """"none", "1.23" or ">= 2" (req/s)."""
        if self.rate is None:
            return "none"
        return f">= {self.rate:g}" if self.censored else f"{self.rate:.2f}"


def goodput(points: Sequence[tuple[float, float]], target: float = GOODPUT_TARGET) -> Goodput:
    """The rate at which attainment falls below `target`, linearly interpolated between the
    last rate of `goodput_rate` and the next swept rate (which missed)."""
    best = goodput_rate(points, target)
    ordered = sorted(points)
    above = [(rate, share) for rate, share in ordered if best is not None and rate > best]
    if best is None or not above:
        return Goodput(best, censored=best is not None)
    kept = max(share for rate, share in ordered if rate == best)
    rate, missed = above[0]
    if math.isnan(missed):
        return Goodput(best)
    return Goodput(best + (rate - best) * (kept - target) / (kept - missed))
