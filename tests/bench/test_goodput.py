"""The goodput benchmark's pure parts: unloaded fit, SLO, plans, requests, verdicts, report."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from PIL import Image

from bench import goodput
from bench.client import RequestResult
from bench.goodput import (
    DEFAULT_RATES,
    Session,
    add_parser,
    make_plan,
    rate_specs,
    run_modes,
    saturated,
)
from bench.goodput_results import (
    GoodputPlan,
    GoodputResults,
    ModeRun,
    RateRun,
    Unloaded,
    fit_unloaded,
    reference_slo,
    samples,
    verdicts,
)
from bench.load import Load, LoadRun
from bench.modes import MODES, probe_specs
from bench.plots import plot_attainment, plot_tpot_cdfs
from bench.prompts import TextPrompts
from bench.report import goodput_json, goodput_markdown, write_json
from bench.stats import Slo
from bench.workloads import LONG_INPUT, Workload


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["goodput", *argv])


def test_fit_unloaded_takes_the_median_ttft_at_each_prompt_length() -> None:
    fit = fit_unloaded([(1100, 2.8, 0.07), (100, 0.3, 0.08), (100, 0.5, 0.09),
                        (100, 0.35, 0.09), (2100, 5.3, None)])
    assert fit.ttft_points == ((100, 0.35), (1100, 2.8), (2100, 5.3))
    assert fit.tpot_s == pytest.approx(0.085)  # median of the requests with a TPOT
    with pytest.raises(ValueError):
        fit_unloaded([(100, 0.3, 0.08), (100, 0.3, 0.08)])
    with pytest.raises(ValueError):
        fit_unloaded([(100, 0.3, None), (200, 0.5, None)])


def test_slo_is_the_factors_times_the_median_of_the_modes_length_by_length() -> None:
    modes = [Unloaded(((16, 0.05), (512, 0.3)), 0.08, ()),
             Unloaded(((16, 0.1), (512, 0.2)), 0.07, ()),
             Unloaded(((16, 0.02), (512, 0.4)), 0.05, ())]
    assert modes[0].slo(5, 2) == Slo(0.25, 0.16, ((16, 0.25), (512, 1.5)))
    slo = reference_slo(modes, ttft_factor=5, tpot_factor=2)
    assert [n for n, _ in slo.ttft_curve] == [16, 512]
    assert [ttft for _, ttft in slo.ttft_curve] == pytest.approx([0.25, 1.5])
    assert slo.tpot_s == pytest.approx(0.14)
    # A short prompt is held to 5x its own unloaded TTFT, not to a line fitted to long ones.
    assert slo.ttft_budget(10) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        reference_slo([*modes, Unloaded(((64, 0.1), (512, 0.3)), 0.05, ())], 5, 2)


def _result(index: int, ttft: float | None, tpot: float, prompt: int = 100,
            tokens: int = 11) -> RequestResult:
    if ttft is None:
        return RequestResult(index, "chat", 0.0, prompt, tokens, error="timeout after 9s")
    e2e = ttft + tpot * (tokens - 1)
    return RequestResult(index, "chat", float(index), prompt, tokens, ttft_s=ttft, e2e_s=e2e,
                         chunk_times_s=tuple(ttft + tpot * i for i in range(tokens)),
                         prompt_tokens=prompt, output_tokens=tokens)


def test_samples_judge_ttft_by_prompt_length_and_count_failures() -> None:
    run = LoadRun((_result(0, 3.0, 0.05, prompt=3000), _result(1, 3.0, 0.05),
                   _result(2, None, 0.0)), 10.0, 0)
    assert samples(run)[0] == pytest.approx((3.0, 0.05, 3000))
    slo = Slo(0.6, 0.1, ((100, 0.6), (3000, 3.5)))  # 3.5 s for 3,000 tokens, 0.6 s for 100
    assert [slo.met(*s) for s in samples(run)] == [True, False, False]
    assert saturated(Slo(0.1, 0.1), run)  # under half within 2x: stop the sweep
    assert not saturated(Slo(1.6, 0.1, ((100, 1.6), (3000, 4.5))), run)  # 2 of 3 within 2x


def _plan(names: tuple[str, ...], rates: dict[str, tuple[float, ...]]) -> GoodputPlan:
    workloads = tuple(Workload(n, output_len=48, max_output_len=48) for n in names)
    return GoodputPlan(tuple(MODES), workloads, rates, {n: r[0] for n, r in rates.items()},
                       duration_s=40.0, min_requests=16)


def test_every_rate_gets_its_own_prompts_and_the_long_share() -> None:
    plan = _plan(("mixed", "chat"), {"mixed": (0.5, 1.0, 3.0), "chat": (0.5, 2.0)})
    specs = rate_specs(plan, TextPrompts())
    assert [len(specs["mixed", r]) for r in (0.5, 1.0, 3.0)] == [20, 40, 120]
    assert len(specs["chat", 0.5]) == 20 and plan.request_count(0.1) == 16
    prompts = [s.prompt for run in specs.values() for s in run]
    assert len(set(prompts)) == len(prompts)  # no prompt twice: no prefix cache carry-over
    for rate in (1.0, 3.0):
        longs = [s for s in specs["mixed", rate] if s.kind == "long"]
        assert 0.05 <= len(longs) / len(specs["mixed", rate]) <= 0.10
        assert all(LONG_INPUT[0] <= (s.input_len or 0) <= LONG_INPUT[1] for s in longs)
    assert max(s.output_len for run in specs.values() for s in run) == 48
    assert specs == rate_specs(plan, TextPrompts())  # the same requests for every mode


def test_probes_warm_up_then_one_request_per_length() -> None:
    probes = probe_specs(TextPrompts(), (64, 512))
    assert [(s.input_len, s.output_len) for s in probes] == [(64, 16), (64, 16), (512, 16)]
    assert len({s.prompt for s in probes}) == 3


def test_plans_from_flags() -> None:
    full = make_plan(_flags())
    assert [w.name for w in full.workloads] == ["chat", "humaneval", "mixed"]
    assert full.rates == DEFAULT_RATES and full.modes == tuple(MODES)
    assert full.compare_rates["mixed"] == DEFAULT_RATES["mixed"][1]
    quick = make_plan(_flags("--quick", "--modes", "disagg,coloc-2x1"))
    assert [w.name for w in quick.workloads] == ["mixed"] and quick.duration_s == 15
    assert quick.modes == ("disagg", "coloc-2x1") and len(quick.rates["mixed"]) == 2
    given = make_plan(_flags("--rates", "2,1", "--compare-rate", "1.5", "--workloads", "chat"))
    assert given.rates == {"chat": (1.0, 1.5, 2.0)} and given.compare_rates == {"chat": 1.5}
    with pytest.raises(SystemExit):
        _flags("--modes", "disagg,nope")
    runs = {name: ModeRun(name, MODES[name], "", Unloaded(((16, 0.1),), 0.05, ()), ())
            for name in ("coloc-2x1", "coloc-1x2", "conditional")}
    assert runs["coloc-2x1"].colocated and runs["coloc-1x2"].colocated
    assert not runs["conditional"].colocated


def _mode(name: str, tpot: float, shares: dict[float, float]) -> ModeRun:
    """A mode whose run at each rate has 10 requests, 10*share of them within the SLO."""
    runs = []
    for rate, share in shares.items():
        good = round(10 * share)
        results = tuple(_result(i, 0.1 if i < good else 50.0, tpot) for i in range(10))
        runs.append(RateRun("mixed", rate, Load(rate=rate), LoadRun(results, 10.0, 0)))
    unloaded = Unloaded(((16, 0.1), (1000, 1.1)), 0.05, ())
    return ModeRun(name, MODES[name], "/tmp/x", unloaded, tuple(runs))


def _results() -> GoodputResults:
    plan = _plan(("mixed",), {"mixed": (0.5, 1.0, 2.0)})
    modes = (_mode("disagg", 0.02, {0.5: 1.0, 1.0: 1.0, 2.0: 0.8}),
             _mode("coloc-2x1", 0.08, {0.5: 1.0, 1.0: 0.8}),
             _mode("coloc-1x2", 0.09, {0.5: 0.7, 1.0: 0.5}))
    return GoodputResults(("python -m bench", "goodput"), plan, "text", modes,
                          {"conditional": "RuntimeError: boom"})


def test_verdicts_against_the_best_colocated_mode() -> None:
    results = _results()
    assert [results.goodput(m, "mixed").rate for m in results.modes] == \
        [pytest.approx(1.5), pytest.approx(0.75), None]
    found = {v.measure: v for v in verdicts(results)}
    assert found["goodput"].ratio == pytest.approx(2.0) and found["goodput"].met
    assert found["p99 TPOT"].ratio == pytest.approx(0.25) and found["p99 TPOT"].met
    slower = _mode("disagg", 0.04, {0.5: 1.0, 1.0: 0.9})
    (tpot, rate) = verdicts(GoodputResults((), results.plan, "text", (slower, *results.modes[1:])))
    assert tpot.ratio == pytest.approx(0.5) and not tpot.met
    assert rate.ratio == pytest.approx(1 / 0.75) and not rate.met
    alone = GoodputResults((), results.plan, "text", results.modes[:1])
    assert verdicts(alone) == []


def test_goodput_report(tmp_path: Path) -> None:
    results = _results()
    markdown = goodput_markdown(results)
    assert "| mixed (p99s at 0.5 req/s) | 1.50 (100 / 20) | 0.75 (100 / 80) | none (" in markdown
    assert "- disagg: goodput 2.00x the best colocated, 1.50 vs 0.75 req/s (coloc-2x1) " \
        "(goal >= 1.5): met" in markdown
    assert "- disagg: p99 TPOT 0.25x the best colocated, 20 ms vs 80 ms (coloc-2x1) " \
        "(goal <= 0.33): met" in markdown
    assert "- conditional FAILED: RuntimeError: boom" in markdown
    assert "| mixed | disagg | 2 | 10 / 0 | 80 % |" in markdown
    write_json(goodput_json(results), tmp_path / "results.json")
    document = json.loads((tmp_path / "results.json").read_text())
    disagg = document["modes"][0]["workloads"]["mixed"]
    assert disagg["goodput"] == {"rate": pytest.approx(1.5), "censored": False}
    assert [r["attainment"] for r in disagg["runs"]] == [1.0, 1.0, 0.8]
    assert len(disagg["runs"][0]["requests"]) == 10 and document["slo"]["tpot_s"] == 0.1
    assert document["plan"]["workloads"][0]["max_output_len"] == 48
    for plot in (plot_attainment, plot_tpot_cdfs):
        plot(results, tmp_path / "p.png")
        with Image.open(tmp_path / "p.png") as image:
            assert image.format == "PNG" and image.size[0] > 400
    assert not math.isnan(document["targets"][0]["ratio"])


def test_a_failing_mode_is_reported_and_the_others_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(session: Session) -> ModeRun:
        if session.mode == "coloc-2x1":
            raise RuntimeError("launch.sh exited (1)")
        session.step(2)
        return _mode(session.mode, 0.02, {0.5: 1.0})

    monkeypatch.setattr(goodput, "measure_mode", measure)
    plan = _plan(("mixed",), {"mixed": (0.5, 1.0)})
    measured, failed = run_modes(plan, TextPrompts())
    assert [m.mode for m in measured] == ["disagg", "conditional", "coloc-1x2"]
    assert failed == {"coloc-2x1": "RuntimeError: launch.sh exited (1)"}
