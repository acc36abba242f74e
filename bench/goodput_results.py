"""What `goodput` measured and how it is judged: the plan, each mode's runs, the one SLO set from
the modes' unloaded latencies, attainment, goodput and the targets' verdicts (bench.goodput
measures; bench.report and bench.plots show)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.load import Load, LoadRun
from bench.stats import Goodput, Sample, Slo, attainment, goodput
from bench.summary import Summary, summarize
from bench.workloads import Workload

PROBE_LENS = (16, 64, 512, 1536)  # the unloaded TTFT is interpolated between them


@dataclass(frozen=True)
class GoodputPlan:
    """What every mode gets: the workloads, their rates, and how long each rate runs."""

    modes: tuple[str, ...]
    workloads: tuple[Workload, ...]
    rates: Mapping[str, tuple[float, ...]]  # workload name -> ascending rates
    compare_rates: Mapping[str, float]  # workload name -> the rate every mode runs, for CDFs
    duration_s: float = 15.0  # of Poisson arrivals per rate
    min_requests: int = 10
    probe_lens: tuple[int, ...] = PROBE_LENS
    ttft_factor: float = 5.0
    tpot_factor: float = 2.0

    def request_count(self, rate: float) -> int:
        """Requests sent at `rate`: its duration's worth, at least `min_requests`."""
        return max(self.min_requests, round(rate * self.duration_s))


@dataclass(frozen=True)
class Unloaded:
    """Single-request latencies of one mode: TTFT at each probed prompt length, and TPOT."""

    ttft_points: tuple[tuple[int, float], ...]  # (prompt tokens, median TTFT), ascending
    tpot_s: float
    samples: tuple[tuple[int, float, float | None], ...]  # (prompt tokens, TTFT, TPOT)

    def slo(self, ttft_factor: float, tpot_factor: float) -> Slo:
        """The SLO these latencies give with the factors: a TTFT budget at every prompt length
        of `ttft_factor` times the unloaded TTFT at that length (see Slo)."""
        curve = tuple((n, ttft_factor * ttft) for n, ttft in self.ttft_points)
        return Slo(curve[0][1], tpot_factor * self.tpot_s, curve)


def fit_unloaded(samples: Sequence[tuple[int, float, float | None]]) -> Unloaded:
    """The median TTFT at each prompt length, and the median TPOT."""
    by_length: dict[int, list[float]] = {}
    for n, ttft, _ in samples:
        by_length.setdefault(n, []).append(ttft)
    if len(by_length) < 2:
        raise ValueError("the unloaded latencies need at least two prompt lengths")
    tpots = [t for _, _, t in samples if t is not None]
    if not tpots:
        raise ValueError("no unloaded request produced two tokens")
    points = tuple((n, statistics.median(ttfts)) for n, ttfts in sorted(by_length.items()))
    return Unloaded(points, statistics.median(tpots), tuple(samples))


def reference_slo(unloaded: Sequence[Unloaded], ttft_factor: float, tpot_factor: float) -> Slo:
    """The one SLO for every mode: the factors times the median of the modes' unloaded figures,
    length by length."""
    lengths = {tuple(n for n, _ in u.ttft_points) for u in unloaded}
    if len(lengths) != 1:
        raise ValueError(f"modes were probed at different prompt lengths: {sorted(lengths)}")
    points = tuple((n, statistics.median(u.ttft_points[i][1] for u in unloaded))
                   for i, n in enumerate(lengths.pop()))
    middle = Unloaded(points, statistics.median(u.tpot_s for u in unloaded), ())
    return middle.slo(ttft_factor, tpot_factor)


def samples(run: LoadRun) -> list[Sample]:
    """(TTFT, TPOT, prompt tokens) of every request sent; failures count as missed."""
    return [(r.ttft_s, r.tpot_s, r.prompt_tokens or r.input_len) for r in run.results]


@dataclass(frozen=True)
class RateRun:
    """One workload at one rate against one mode."""

    workload: str
    rate: float
    load: Load
    run: LoadRun


@dataclass(frozen=True)
class ModeRun:
    """Everything measured on one mode."""

    mode: str
    flags: tuple[str, ...]
    run_dir: str
    unloaded: Unloaded
    runs: tuple[RateRun, ...]

    @property
    def colocated(self) -> bool:
        """Whether the mode prefills and decodes in the same workers."""
        return "--colocated" in self.flags


@dataclass(frozen=True)
class Point:
    """One rate of one mode's sweep of one workload, judged against the reference SLO."""

    rate: float
    attainment: float
    summary: Summary
    run: LoadRun


@dataclass(frozen=True)
class GoodputResults:
    """A whole `goodput` invocation: the plan, every mode's measurements and the SLO."""

    command: tuple[str, ...]
    plan: GoodputPlan
    prompts: str
    modes: tuple[ModeRun, ...]
    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)  # mode -> why

    @property
    def slo(self) -> Slo:
        """The reference SLO every run is judged against."""
        plan = self.plan
        return reference_slo([m.unloaded for m in self.modes], plan.ttft_factor, plan.tpot_factor)

    def points(self, mode: ModeRun, workload: str) -> list[Point]:
        """The swept rates of `workload` on `mode`, ascending."""
        slo = self.slo
        return [Point(r.rate, attainment(slo, samples(r.run)), summarize(r.run, slo), r.run)
                for r in sorted(mode.runs, key=lambda r: r.rate) if r.workload == workload]

    def goodput(self, mode: ModeRun, workload: str) -> Goodput:
        """`mode`'s goodput on `workload`."""
        return goodput([(p.rate, p.attainment) for p in self.points(mode, workload)])

    def at_compare_rate(self, mode: ModeRun, workload: str) -> Point | None:
        """`mode`'s run of `workload` at the comparison rate."""
        rate = self.plan.compare_rates[workload]
        return next((p for p in self.points(mode, workload) if p.rate == rate), None)

    def targets(self) -> list[Verdict]:
        """The issue's targets on the mixed workload (see `verdicts`)."""
        return verdicts(self)


@dataclass(frozen=True)
class Verdict:
    """One of the issue's targets for one disaggregated mode against the best colocated one."""

    mode: str
    measure: str  # what was compared, e.g. "p99 TPOT"
    ratio: float  # the mode's figure over the best colocated figure (NaN: not measurable)
    goal: str  # "<= 0.33" or ">= 1.5"
    met: bool
    figures: str  # both figures, e.g. "80 ms vs 400 ms (coloc-2x1)"; ">=": a censored goodput


def verdicts(results: GoodputResults, workload: str = "mixed") -> list[Verdict]:
    """p99 TPOT (at the comparison rate) and goodput of every disaggregated mode against the best
    colocated mode on `workload`; none unless both kinds were measured."""
    together = [m for m in results.modes if m.colocated]
    apart = [m for m in results.modes if not m.colocated]
    if workload not in results.plan.rates or not together or not apart:
        return []
    tpots = {m.mode: _p99_tpot(results, m, workload) for m in together}
    tpot_mode = min(tpots, key=lambda m: math.inf if math.isnan(tpots[m]) else tpots[m])
    rates = {m.mode: results.goodput(m, workload) for m in together}
    rate_mode = max(rates, key=lambda m: rates[m].rate or 0.0)
    best = rates[rate_mode].rate or 0.0
    found = []
    for mode in apart:
        p99 = _p99_tpot(results, mode, workload)
        tpot = p99 / tpots[tpot_mode]
        own = results.goodput(mode, workload)
        rate = own.rate or 0.0
        ratio = rate / best if best > 0 else (math.inf if rate > 0 else math.nan)
        found += [Verdict(mode.mode, "p99 TPOT", tpot, "<= 0.33", tpot <= 1 / 3,
                          f"{p99 * 1000:.0f} ms vs {tpots[tpot_mode] * 1000:.0f} ms ({tpot_mode})"),
                  Verdict(mode.mode, "goodput", ratio, ">= 1.5", ratio >= 1.5,
                          f"{own.describe()} vs {rates[rate_mode].describe()} req/s "
                          f"({rate_mode})")]
    return found


def _p99_tpot(results: GoodputResults, mode: ModeRun, workload: str) -> float:
    point = results.at_compare_rate(mode, workload)
    return math.nan if point is None else point.summary.tpot_s.p99
