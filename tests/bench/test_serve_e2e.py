"""`python -m bench serve` against a real server (tiny model) started with launch.sh."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from bench.__main__ import main
from bench.launcher import memory
from tests.e2e.cluster import Cluster, launch

pytestmark = pytest.mark.e2e

MEASURES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir) as running:
        yield running


def _check_distribution(stats: dict[str, float], count: int, low: float, high: float) -> None:
    assert stats["count"] == count
    values = [stats[k] for k in ("mean", "p50", "p90", "p99")]
    assert all(low < v < high for v in values), stats
    assert stats["p50"] <= stats["p90"] <= stats["p99"]


def test_serve_measures_a_real_server(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "results.json"
    status = main(["serve", "--url", f"tiny={cluster.url}", "--tokenizer", str(tiny_model_dir),
                   "--workload", "fixed", "--input-len", "48", "--output-len", "12",
                   "--num-requests", "8", "--concurrency", "4", "--warmup", "2",
                   "--slo-ttft", "30", "--slo-tpot", "10", "--out", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    (target,) = report["targets"]
    (run,) = target["runs"]
    summary = run["summary"]
    assert target["model"] == cluster.model and run["label"] == "tiny c=4"
    assert (summary["completed"], summary["failed"], summary["unsent"]) == (8, 0, 0)
    assert summary["output_tokens"] == 8 * 12 and summary["input_tokens"] == 8 * 48
    requests = run["requests"]
    gaps = sum(len(r["chunk_times_s"]) - 1 for r in requests)  # a chunk may hold several tokens
    for name in MEASURES:
        _check_distribution(summary[name], gaps if name == "itl_s" else 8, 0.0, 30.0)
    assert summary["ttft_s"]["p50"] < summary["e2e_s"]["p50"]
    elapsed = summary["duration_s"]
    assert 0 < elapsed < 60
    assert summary["output_tokens_per_s"] == pytest.approx(96 / elapsed)
    assert summary["requests_per_s"] == pytest.approx(8 / elapsed)
    assert summary["slo_attainment"] == 1.0
    assert summary["goodput_requests_per_s"] == pytest.approx(8 / elapsed)
    assert [r["index"] for r in requests] == list(range(2, 10))  # warm-up not counted
    for request in requests:
        assert request["ok"] and request["prompt_tokens"] == 48 and request["output_tokens"] == 12
        assert 1 <= len(request["chunk_times_s"]) <= 12
        assert request["chunk_times_s"][0] == request["ttft_s"] <= request["e2e_s"]
        tpot = (request["e2e_s"] - request["ttft_s"]) / 11
        assert request["tpot_s"] == pytest.approx(tpot)
    assert not math.isnan(summary["tpot_s"]["p99"])
    with Image.open(out.with_suffix(".png")) as image:
        assert image.format == "PNG"
    assert "| output tokens/s |" in capsys.readouterr().out
    used = memory(cluster.run_dir)
    assert set(used) == {"gateway", "prefill-0", "decode-0"}
    assert all(0 < m.pss_mb <= m.rss_mb <= m.peak_rss_mb for m in used.values())
