"""Benchmark PNGs: serve's latency CDFs and figures against rate; goodput's attainment and TPOT
CDFs per mode; peers' throughput against concurrency and latency CDFs per target; embeddings'
inputs/s and latency against concurrency."""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state

from bench.embedding_results import EmbeddingsResults, concurrencies, summarize_run
from bench.goodput_results import GoodputResults
from bench.results import Measured, PeersResults, ServeResults, TargetResults
from bench.stats import GOODPUT_TARGET


def cdf(axes: Axes, values: list[float], label: str) -> None:
    """One empirical CDF line (values in seconds, drawn in ms)."""
    ordered = sorted(v * 1000 for v in values)
    if not ordered:
        return
    shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axes.step([ordered[0], *ordered], [0.0, *shares], where="post", label=label)


def _legend(axes: Axes) -> None:
    """A small legend, when anything was drawn with a label."""
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="x-small")


def _latency_cdfs(results: ServeResults, ttft: Axes, tpot: Axes, itl: Axes) -> None:
    for target in results.targets:
        for measured in target.runs:
            done = [r for r in measured.run.results if r.ok]
            label = measured.label(target.label)
            cdf(ttft, [r.ttft_s for r in done if r.ttft_s is not None], label)
            cdf(tpot, [t for r in done if (t := r.tpot_s) is not None], label)
            cdf(itl, [gap for r in done for gap in r.itl_s], label)
    for axes, name, limit in ((ttft, "TTFT", results.slo.ttft_s),
                              (tpot, "TPOT", results.slo.tpot_s), (itl, "ITL", None)):
        if limit is not None:
            axes.axvline(limit * 1000, color="grey", linestyle=":", label="SLO")
        axes.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="share of requests",
                 ylim=(0, 1.02))
        _legend(axes)


def _rate(measured: Measured) -> float:
    assert measured.load.rate is not None, "every run of a sweep has its rate"
    return measured.load.rate


def _against_rate(targets: tuple[TargetResults, ...], throughput: Axes, latency: Axes,
                  slo: Axes) -> None:
    for target in targets:
        rates = [_rate(m) for m in target.runs]
        summaries = [m.summary for m in target.runs]
        throughput.plot(rates, [s.output_tokens_per_s for s in summaries], "o-",
                        label=target.label)
        latency.plot(rates, [s.ttft_s.p99 * 1000 for s in summaries], "o-",
                     label=f"{target.label} TTFT p99")
        latency.plot(rates, [s.tpot_s.p99 * 1000 for s in summaries], "s--",
                     label=f"{target.label} TPOT p99")
        slo.plot(rates, [100 * s.slo_attainment for s in summaries], "o-", label=target.label)
    slo.axhline(100 * GOODPUT_TARGET, color="grey", linestyle=":", label="goodput target")
    throughput.set(title="throughput", xlabel="rate (req/s)", ylabel="output tokens/s")
    latency.set(title="p99 latency", xlabel="rate (req/s)", ylabel="ms", yscale="log")
    slo.set(title="SLO attainment", xlabel="rate (req/s)", ylabel="% of requests",
            ylim=(0, 105))
    for axes in (throughput, latency, slo):
        _legend(axes)


def plot_serve(results: ServeResults, path: Path) -> None:
    """Write the PNG: TTFT, TPOT and ITL CDFs; with a sweep, a second row against rate."""
    rows = 2 if results.sweep else 1
    figure = Figure(figsize=(16, 4.5 * rows))
    grid = figure.subplots(rows, 3, squeeze=False)
    _latency_cdfs(results, *grid[0])
    if results.sweep:
        _against_rate(results.targets, *grid[1])
    _save(figure, path, f"workload {results.workload.name}, {results.num_requests} requests")


def _panels(count: int, height: float = 4.0) -> tuple[Figure, list[Axes]]:
    """A figure with `count` panels side by side."""
    figure = Figure(figsize=(5.5 * count, height))
    return figure, list(figure.subplots(1, count, squeeze=False)[0])


def _save(figure: Figure, path: Path, title: str) -> None:
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def plot_attainment(results: GoodputResults, path: Path) -> None:
    """SLO attainment against rate, one panel per workload, one line per mode."""
    figure, panels = _panels(len(results.plan.workloads))
    for axes, workload in zip(panels, results.plan.workloads, strict=True):
        for mode in results.modes:
            points = results.points(mode, workload.name)
            label = f"{mode.mode} (goodput {results.goodput(mode, workload.name).describe()})"
            axes.plot([p.rate for p in points], [100 * p.attainment for p in points], "o-",
                      label=label)
        axes.axhline(100 * GOODPUT_TARGET, color="grey", linestyle=":", label="goodput target")
        axes.set(title=workload.name, xlabel="rate (req/s)", ylabel="% of requests within SLO",
                 ylim=(0, 105))
        _legend(axes)
    _save(figure, path, "SLO attainment against Poisson arrival rate")


def plot_tpot_cdfs(results: GoodputResults, path: Path) -> None:
    """TPOT CDFs per mode at each workload's comparison rate, with the TPOT SLO."""
    figure, panels = _panels(len(results.plan.workloads))
    for axes, workload in zip(panels, results.plan.workloads, strict=True):
        for mode in results.modes:
            point = results.at_compare_rate(mode, workload.name)
            if point is not None:
                cdf(axes, [t for r in point.run.results if (t := r.tpot_s) is not None],
                    mode.mode)
        axes.axvline(results.slo.tpot_s * 1000, color="grey", linestyle=":", label="TPOT SLO")
        rate = results.plan.compare_rates[workload.name]
        axes.set(title=f"{workload.name} @ {rate:g} req/s", xlabel="TPOT (ms)",
                 ylabel="share of requests", ylim=(0, 1.02), xscale="log")
        _legend(axes)
    _save(figure, path, "TPOT CDF per mode")


def plot_peers(results: PeersResults, path: Path) -> None:
    """Output tokens/s against concurrency, one line per target; TTFT and ITL CDFs per run."""
    figure, (throughput, ttft, itl) = _panels(3, height=4.5)
    for target in results.serve.targets:
        runs = sorted(target.runs, key=lambda m: m.load.concurrency or 0)
        throughput.plot([m.load.concurrency or 0 for m in runs],
                        [m.summary.output_tokens_per_s for m in runs], "o-", label=target.label)
        for measured in runs:
            done = [r for r in measured.run.results if r.ok]
            label = measured.label(target.label)
            cdf(ttft, [r.ttft_s for r in done if r.ttft_s is not None], label)
            cdf(itl, [gap for r in done for gap in r.itl_s], label)
    throughput.set(title="throughput", xlabel="concurrent streams", ylabel="output tokens/s",
                   xscale="log", ylim=(0, None))
    loads = sorted({m.load.concurrency or 0 for t in results.serve.targets for m in t.runs})
    throughput.set_xticks(loads, [str(load) for load in loads])  # not 2x10^0 between them
    throughput.minorticks_off()
    ttft.set(title="TTFT CDF", xlabel="TTFT (ms)", ylabel="share of requests", ylim=(0, 1.02),
             xscale="log")
    itl.set(title="ITL CDF", xlabel="inter-token gap (ms)", ylabel="share of gaps",
            ylim=(0, 1.02), xscale="log")
    for axes in (throughput, ttft, itl):
        _legend(axes)
    _save(figure, path, f"{results.cpu.model}, CPUs {results.cpus}: "
                        f"{results.serve.workload.name}, {results.serve.num_requests} requests "
                        "per run")


def _concurrency_axis(axes: Axes, levels: tuple[int, ...]) -> None:
    """A log axis of concurrencies, ticked at each one measured (not 2x10^0 between them)."""
    axes.set(xlabel="concurrent requests", xscale="log")
    axes.set_xticks(levels, [str(level) for level in levels])
    axes.minorticks_off()


def plot_embeddings(results: EmbeddingsResults, path: Path) -> None:
    """Inputs/s and request latency p50 against concurrency, one line per target."""
    figure, (throughput, latency) = _panels(2, height=4.5)
    for target in results.targets:
        summaries = sorted((summarize_run(run) for run in target.runs),
                           key=lambda s: s.concurrency)
        levels = [s.concurrency for s in summaries]
        throughput.plot(levels, [s.inputs_per_s for s in summaries], "o-", label=target.label)
        latency.plot(levels, [s.latency_p50_s * 1000 for s in summaries], "o-",
                     label=target.label)
    throughput.set(title="throughput", ylabel="inputs/s", ylim=(0, None))
    latency.set(title="request latency p50", ylabel="ms", ylim=(0, None))
    for axes in (throughput, latency):
        _concurrency_axis(axes, concurrencies(results))
        _legend(axes)
    plan = results.plan
    _save(figure, path, f"{results.cpu.model}, CPUs {results.cpus}: {plan.num_inputs} texts of "
                        f"~{plan.input_tokens} tokens, {plan.batch} per request")
