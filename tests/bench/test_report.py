"""JSON, Markdown and PNG of hand-made serve results, including a rate sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from bench.client import RequestResult
from bench.launcher import ProcessMemory
from bench.load import Load, LoadRun
from bench.plots import plot_serve
from bench.report import serve_json, serve_markdown, write_json
from bench.results import Measured, ServeResults, TargetResults
from bench.stats import Slo
from bench.summary import summarize
from bench.workloads import Workload

SLO = Slo(ttft_s=1.0, tpot_s=0.1)


def _run(rate: float, ttfts: list[float]) -> Measured:
    results = tuple(
        RequestResult(i, "chat", i / rate, 20, 5, ttft_s=t, e2e_s=t + 0.2,
                      chunk_times_s=(t, t + 0.05, t + 0.1, t + 0.15, t + 0.2),
                      prompt_tokens=20, output_tokens=5)
        for i, t in enumerate(ttfts))
    load = Load(rate=rate, request_timeout_s=10)
    return Measured(load, LoadRun(results, 4.0, 0), summarize(LoadRun(results, 4.0, 0), SLO))


def _sweep() -> ServeResults:
    ours = TargetResults("ours", "http://a", "m", (
        _run(1, [0.1] * 10), _run(2, [0.1] * 9 + [3.0]), _run(4, [3.0] * 10)),
        launch_flags=("--prefill", "1"), memory={"gateway": ProcessMemory(300, 250, 310)})
    other = TargetResults("other", "http://b", "m", (
        _run(1, [0.5] * 8 + [5.0] * 2), _run(2, [5.0] * 10), _run(4, [5.0] * 10)))
    return ServeResults(("python -m bench",), Workload("chat"), "text", 10, 0, SLO, True,
                        (ours, other))


def test_sweep_report(tmp_path: Path) -> None:
    results = _sweep()
    assert [t.goodput_rate() for t in results.targets] == [2, None]
    markdown = serve_markdown(results)
    assert "- ours: 2 req/s" in markdown and "- other: none" in markdown
    assert "| memory gateway RSS / PSS / peak RSS (MB) | 300 / 250 / 310 |" in markdown
    assert "ours @ 4 req/s" in markdown
    write_json(serve_json(results), tmp_path / "r.json")
    document = json.loads((tmp_path / "r.json").read_text())
    assert [t["goodput_rate"] for t in document["targets"]] == [2, None]
    run = document["targets"][0]["runs"][1]
    assert run["summary"]["slo_attainment"] == 0.9 and len(run["requests"]) == 10
    assert run["summary"]["tpot_s"]["p50"] == pytest.approx(0.05)
    plot_serve(results, tmp_path / "r.png")
    with Image.open(tmp_path / "r.png") as image:
        assert image.format == "PNG" and image.size[0] > 1000


def test_no_nan_in_json(tmp_path: Path) -> None:
    failed = RequestResult(0, "chat", 0.0, 20, 5, error="HTTP 500: no")
    run = LoadRun((failed,), 1.0, 0)
    target = TargetResults("x", "http://x", "m", (Measured(Load(concurrency=1), run,
                                                           summarize(run, SLO)),))
    results = ServeResults((), Workload("fixed"), "text", 1, 0, SLO, False, (target,))
    write_json(serve_json(results), tmp_path / "r.json")
    summary = json.loads((tmp_path / "r.json").read_text())["targets"][0]["runs"][0]["summary"]
    assert summary["ttft_s"]["p50"] is None and summary["failed"] == 1
    assert summary["errors"] == {"HTTP 500": 1}
    markdown = serve_markdown(results)
    assert "| requests completed / failed / unsent | 0 / 1 / 0 |" in markdown
    assert "| failures by kind | HTTP 500 x1 |" in markdown
    plot_serve(results, tmp_path / "r.png")  # nothing to draw is not an error
