"""goodput --autoscale's step load: its phases and layouts, and the table and plot it makes
from measured runs (the runs here are built, not served: the serving is bench goodput's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import goodput
from bench.client import RequestResult
from bench.goodput_results import Unloaded
from bench.load import LoadRun
from bench.stats import Slo
from bench.steps import LayoutRun, layouts, phases, plot, report, summary

SLO = Slo(ttft_s=0.5, tpot_s=0.1)


def result(index: int, ttft_s: float | None, tpot_s: float, error: str = "") -> RequestResult:
    chunks = (ttft_s or 0.0, (ttft_s or 0.0) + tpot_s)  # two tokens: TPOT is their gap
    return RequestResult(index, "chat", 0.0, 100, 2, error, ttft_s, chunks[-1], chunks,
                         100, 2)


def test_the_load_steps_from_chats_to_long_prompts_and_back() -> None:
    plan = phases(40.0, 2.0, 0.3, 48)
    assert [(p.name, p.workload.name, p.rate) for p in plan] == [
        ("chat", "chat", 2.0), ("long prompts", "mixed", 0.3), ("chat again", "chat", 2.0)]
    assert plan[1].workload.long_share == 1.0  # every prompt 2,000-4,000 tokens
    assert plan[0].workload.seed != plan[2].workload.seed  # fresh prompts when the chats return


def test_the_autoscaled_layout_starts_as_the_fixed_one_and_adds_the_bounds() -> None:
    compared = layouts("1:3")
    assert compared["fixed 1P+1D"] == goodput.MODES["conditional"]
    assert compared["autoscale 1:3"] == (*goodput.MODES["conditional"], "--autoscale", "1:3")


def test_attainment_counts_failures_as_missed_and_the_table_has_every_phase(
        tmp_path: Path) -> None:
    good, slow, failed = result(0, 0.2, 0.05), result(1, 0.9, 0.05), result(2, None, 0.0, "x")
    run = LoadRun((good, slow, failed), 10.0, 0)
    assert summary(SLO, run)["attainment"] == pytest.approx(1 / 3)
    plan = phases(10.0, 1.0, 0.5, 8)
    unloaded = Unloaded(((16, 0.1), (64, 0.2)), 0.05, ())
    measured = [LayoutRun("fixed 1P+1D", (), unloaded, (run, run, run), ()),
                LayoutRun("autoscale 1:2", (), unloaded, (run,) * 3, ((0.0, 1, 1), (5.0, 1, 2)))]
    table = report(plan, measured, SLO)
    assert "| fixed 1P+1D | 33 % " in table and table.count("| autoscale 1:2 |") == 1
    assert "chat again at 1 req/s for 10 s" in table
    plot(plan, measured, SLO, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").stat().st_size > 10_000
