"""Results as JSON (every measure and every request) and as Markdown tables for the terminal."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.client import RequestResult
from bench.goodput_results import GoodputResults, ModeRun, Point
from bench.results import Measured, PeersResults, ServeResults, TargetResults
from bench.runner import RunnerResults
from bench.stats import GOODPUT_TARGET, Distribution, percentile
from engine.kernels.isa import ISA_FLAGS, cpu_flags, cpu_name


def jsonable(value: Any) -> Any:
    """`value` with dataclasses as dicts and NaN/inf as None, so strict JSON parsers accept it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(document: dict[str, Any], path: Path) -> None:
    """Write `document` as indented strict JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(document), indent=2, allow_nan=False) + "\n")


def _run_json(target: str, measured: Measured) -> dict[str, Any]:
    return {"label": measured.label(target), "load": measured.load,
            "summary": measured.summary,
            "requests": [request_json(r) for r in measured.run.results]}


def _target_json(target: TargetResults) -> dict[str, Any]:
    return {"label": target.label, "url": target.url, "model": target.model,
            "launch_flags": target.launch_flags, "run_dir": target.run_dir,
            "memory_mb": target.memory, "goodput_rate": target.goodput_rate(),
            "runs": [_run_json(target.label, m) for m in target.runs]}


def serve_json(results: ServeResults) -> dict[str, Any]:
    """The whole serve report: settings, then per target its memory and per run every measure."""
    return {
        "benchmark": "serve", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": results.command, "workload": results.workload.describe(),
        "prompts": results.prompts, "num_requests": results.num_requests,
        "warmup": results.warmup, "slo": results.slo, "sweep": results.sweep,
        "goodput_target": GOODPUT_TARGET,
        "targets": [_target_json(t) for t in results.targets],
    }


def runner_json(results: RunnerResults) -> dict[str, Any]:
    """The runner microbenchmark's figures, with the speedups of ours over transformers."""
    return {"benchmark": "runner", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": results.model, "threads": results.threads, "plan": results.plan,
            "quant_rows": results.quant_rows, "kernels": results.isa,
            "cpu": {"name": cpu_name(), "flags": sorted(cpu_flags() & ISA_FLAGS)},
            "ours": results.ours, "transformers": results.transformers,
            "same_next_token": results.same_next_token,
            "speedup": {"prefill": results.prefill_speedup(),
                        "decode": results.decode_speedup()}}


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def ms_cell(value: float) -> str:
    """Seconds as whole milliseconds in a table cell; "-" for none (NaN)."""
    return "-" if math.isnan(value) else f"{value * 1000:.0f}"


def _stats_row(name: str, pick: Callable[[Measured], Distribution],
               runs: list[Measured]) -> list[str]:
    cells = [" / ".join(ms_cell(v) for v in (d.mean, d.p50, d.p90, d.p99))
             for d in (pick(m) for m in runs)]
    return [f"{name} mean / p50 / p90 / p99 (ms)", *cells]


def _per_stream_rate(measured: Measured) -> str:
    p50 = measured.summary.tpot_s.p50
    return "-" if math.isnan(p50) or p50 <= 0 else f"{1 / p50:.1f}"


def serve_markdown(results: ServeResults) -> str:
    """One column per run (target and load), one row per measure; then the sweep, if any."""
    runs = [(t, m) for t in results.targets for m in t.runs]
    measured = [m for _, m in runs]
    slo = results.slo
    rows = [
        ["requests completed / failed / unsent",
         *(f"{m.summary.completed} / {m.summary.failed} / {m.summary.unsent}" for m in measured)],
        ["requests/s", *(f"{m.summary.requests_per_s:.2f}" for m in measured)],
        ["output tokens/s", *(f"{m.summary.output_tokens_per_s:.1f}" for m in measured)],
        _stats_row("TTFT", lambda m: m.summary.ttft_s, measured),
        _stats_row("TPOT", lambda m: m.summary.tpot_s, measured),
        _stats_row("ITL", lambda m: m.summary.itl_s, measured),
        _stats_row("E2E", lambda m: m.summary.e2e_s, measured),
        ["decode tokens/s per stream (1 / TPOT p50)", *(_per_stream_rate(m) for m in measured)],
        [f"SLO attainment (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s)",
         *(f"{100 * m.summary.slo_attainment:.1f} %" for m in measured)],
        ["goodput (requests/s within SLO)",
         *(f"{m.summary.goodput_requests_per_s:.2f}" for m in measured)],
        *_failure_rows(measured),
        *_memory_rows(runs),
    ]
    title = (f"workload {results.workload.name}, {results.num_requests} requests, "
             f"prompts as {results.prompts.split(' (')[0]}")
    parts = [title, table(["measure", *(m.label(t.label) for t, m in runs)], rows)]
    return "\n\n".join(parts + ([_sweep_markdown(results)] if results.sweep else []))


def _failure_rows(runs: list[Measured]) -> list[list[str]]:
    """A row naming the kinds of failure, when any request failed."""
    if not any(m.summary.errors for m in runs):
        return []
    cells = [", ".join(f"{kind} x{n}" for kind, n in m.summary.errors.items()) or "-"
             for m in runs]
    return [["failures by kind", *cells]]


def _memory_rows(runs: list[tuple[TargetResults, Measured]]) -> list[list[str]]:
    names = sorted({name for t, _ in runs for name in (t.memory or {})})
    rows = []
    for name in names:
        cells = []
        for target, _ in runs:
            used = (target.memory or {}).get(name)
            cells.append("-" if used is None else
                         f"{used.rss_mb:.0f} / {used.pss_mb:.0f} / {used.peak_rss_mb:.0f}")
        rows.append([f"memory {name} RSS / PSS / peak RSS (MB)", *cells])
    return rows


def _sweep_markdown(results: ServeResults) -> str:
    rows = [[t.label, f"{m.load.rate:g}", f"{100 * m.summary.slo_attainment:.1f} %",
             f"{m.summary.output_tokens_per_s:.1f}", ms_cell(m.summary.ttft_s.p99),
             ms_cell(m.summary.tpot_s.p99)]
            for t in results.targets for m in t.runs]
    verdicts = [f"- {t.label}: " + ("none" if (r := t.goodput_rate()) is None else f"{r:g} req/s")
                for t in results.targets]
    header = ["target", "rate (req/s)", "SLO attainment", "output tokens/s",
              "TTFT p99 (ms)", "TPOT p99 (ms)"]
    return "\n".join([table(header, rows), "",
                      f"Goodput rate (highest rate with >= {100 * GOODPUT_TARGET:.0f} % "
                      "of requests within SLO):", *verdicts])


def runner_markdown(results: RunnerResults) -> str:
    """Ours, transformers and the speedup for every prefill length and decode batch size."""
    ours, theirs = results.ours, results.transformers
    rows = [[f"prefill tokens/s, {n} tokens", f"{ours.prefill_tokens_per_s[n]:.0f}",
             f"{theirs.prefill_tokens_per_s[n]:.0f}", f"{speedup:.2f}x"]
            for n, speedup in results.prefill_speedup().items()]
    rows += [[f"decode step ms, batch {b} (context {results.plan.context})",
              f"{ours.decode_step_s[b] * 1000:.1f}", f"{theirs.decode_step_s[b] * 1000:.1f}",
              f"{speedup:.2f}x"]
             for b, speedup in results.decode_speedup().items()]
    same = "yes" if results.same_next_token else "NO"
    return "\n\n".join([
        f"model {results.model}, {results.plan.dtype}, {results.threads} threads, kernels "
        f"{results.isa} on {cpu_name() or 'an unknown CPU'}, ours over the weights' blocks up "
        f"to {results.quant_rows} rows; same greedy next token: {same}",
        table(["measure", "ours", "transformers", "speedup (ours/transformers)"], rows)])


def request_json(result: RequestResult) -> dict[str, Any]:
    """One request with its derived `ok` and `tpot_s`."""
    return {**dataclasses.asdict(result), "ok": result.ok, "tpot_s": result.tpot_s}


def _point_json(point: Point) -> dict[str, Any]:
    summary = point.summary
    return {"rate": point.rate, "attainment": point.attainment, "sent": len(point.run.results),
            "completed": summary.completed, "failed": summary.failed,
            "errors": summary.errors, "duration_s": summary.duration_s,
            "requests_per_s": summary.requests_per_s,
            "output_tokens_per_s": summary.output_tokens_per_s,
            "ttft_s": summary.ttft_s, "tpot_s": summary.tpot_s,
            "requests": [request_json(r) for r in point.run.results]}


def _mode_json(results: GoodputResults, mode: ModeRun) -> dict[str, Any]:
    workloads = {w.name: {"goodput": results.goodput(mode, w.name),
                          "compare_rate": results.plan.compare_rates[w.name],
                          "runs": [_point_json(p) for p in results.points(mode, w.name)]}
                 for w in results.plan.workloads}
    return {"mode": mode.mode, "launch_flags": mode.flags, "run_dir": mode.run_dir,
            "unloaded": mode.unloaded, "workloads": workloads}


def goodput_json(results: GoodputResults) -> dict[str, Any]:
    """The whole goodput report: plan, SLO, per mode its unloaded fit and every run."""
    plan = results.plan
    return {"benchmark": "goodput", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": results.command, "prompts": results.prompts,
            "plan": {**dataclasses.asdict(plan),
                     "workloads": [w.describe() for w in plan.workloads]},
            "slo": results.slo, "goodput_target": GOODPUT_TARGET,
            "failed_modes": results.failed,
            "modes": [_mode_json(results, m) for m in results.modes],
            "targets": results.targets()}


def _slo_line(results: GoodputResults) -> str:
    slo, plan = results.slo, results.plan
    budgets = " / ".join(f"{budget * 1000:.0f}" for _, budget in slo.ttft_curve)
    lengths = " / ".join(f"{n:,}" for n, _ in slo.ttft_curve)
    return (f"SLO, from the median of the modes' unloaded latencies: TTFT <= {budgets} ms at "
            f"{lengths} prompt tokens ({plan.ttft_factor:g}x unloaded; linear between, the last "
            f"segment extended beyond), TPOT <= {slo.tpot_s * 1000:.0f} ms "
            f"({plan.tpot_factor:g}x unloaded). Goodput: the rate at which fewer than "
            f"{100 * GOODPUT_TARGET:.0f} % of requests meet both, interpolated between swept "
            "rates.")


def _unloaded_table(results: GoodputResults) -> str:
    rows = [[m.mode, f"`{' '.join(m.flags)}`",
             " / ".join(ms_cell(ttft) for _, ttft in m.unloaded.ttft_points),
             ms_cell(m.unloaded.tpot_s)]
            for m in results.modes]
    lengths = " / ".join(f"{n:,}" for n, _ in results.modes[0].unloaded.ttft_points)
    return table(["mode", "launch.sh flags", f"TTFT at {lengths} tokens (ms)", "TPOT (ms)"], rows)


def _goodput_table(results: GoodputResults) -> str:
    rows = []
    for workload in results.plan.workloads:
        rate = results.plan.compare_rates[workload.name]
        cells = []
        for mode in results.modes:
            point = results.at_compare_rate(mode, workload.name)
            p99 = "-" if point is None else \
                f"{ms_cell(point.summary.ttft_s.p99)} / {ms_cell(point.summary.tpot_s.p99)}"
            cells.append(f"{results.goodput(mode, workload.name).describe()} ({p99})")
        rows.append([f"{workload.name} (p99s at {rate:g} req/s)", *cells])
    return table(["workload", *(m.mode for m in results.modes)], rows)


def _runs_table(results: GoodputResults) -> str:
    rows = [[w.name, m.mode, f"{p.rate:g}", f"{len(p.run.results)} / {p.summary.failed}",
             f"{100 * p.attainment:.0f} %", ms_cell(p.summary.ttft_s.p99),
             ms_cell(p.summary.tpot_s.p99), f"{p.summary.output_tokens_per_s:.0f}"]
            for w in results.plan.workloads for m in results.modes
            for p in results.points(m, w.name)]
    return table(["workload", "mode", "rate (req/s)", "sent / failed", "SLO attainment",
                  "p99 TTFT (ms)", "p99 TPOT (ms)", "output tokens/s"], rows)


def _verdict_lines(results: GoodputResults) -> list[str]:
    found = results.targets()
    if not found:
        return []
    lines = [f"Targets, mixed workload (p99 TPOT at "
             f"{results.plan.compare_rates['mixed']:g} req/s), against the best colocated mode:"]
    lines += [f"- {v.mode}: {v.measure} {v.ratio:.2f}x the best colocated, {v.figures} "
              f"(goal {v.goal}): {'met' if v.met else 'NOT met'}" for v in found]
    return lines


def goodput_markdown(results: GoodputResults) -> str:
    """The SLO, the unloaded latencies, goodput per workload and mode, every run, the targets."""
    failed = [f"- {mode} FAILED: {why}" for mode, why in results.failed.items()]
    parts = ["Goodput: disaggregated against colocated serving on the same CPUs",
             f"Command: `{' '.join(results.command)}`", _slo_line(results),
             "Unloaded latencies (one request at a time):", _unloaded_table(results),
             "Goodput (req/s) per workload, with p99 TTFT / p99 TPOT (ms) at the comparison "
             "rate:", _goodput_table(results), "Every run:", _runs_table(results)]
    tail = [line for line in (*_verdict_lines(results), *failed) if line]
    return "\n\n".join(parts + (["\n".join(tail)] if tail else []))


def _p50_prompt_tokens(measured: Measured) -> float | None:
    counts = [r.prompt_tokens for r in measured.run.results if r.ok and r.prompt_tokens]
    return percentile(counts, 50) if counts else None


def peers_summary(results: PeersResults) -> list[dict[str, Any]]:
    """Per target and concurrency: output tokens/s, TTFT, ITL and TPOT p50, the prompt tokens
    the server counted, and the throughput over each peer's."""
    rows = []
    for target in results.serve.targets:
        runs = {}
        for measured in target.runs:
            concurrency = measured.load.concurrency
            assert concurrency is not None, "peers runs are closed loops"
            summary = measured.summary
            runs[concurrency] = {
                "output_tokens_per_s": summary.output_tokens_per_s,
                "ttft_p50_s": summary.ttft_s.p50, "itl_p50_s": summary.itl_s.p50,
                "tpot_p50_s": summary.tpot_s.p50,
                "prompt_tokens_p50": _p50_prompt_tokens(measured),
                "completed": summary.completed, "failed": summary.failed,
                "vs": {ref: results.ratio(target.label, ref, concurrency)
                       for ref in results.references() if ref != target.label}}
        rows.append({"label": target.label, "peer": target.label in results.peers,
                     "kernel_isa": results.kernel_isa.get(target.label, []), "runs": runs})
    return rows


def peers_json(results: PeersResults) -> dict[str, Any]:
    """serve's whole report of the targets, with the CPU, the peers' commands, our kernel ISAs,
    the failures and the side-by-side summary."""
    return {**serve_json(results.serve), "benchmark": "peers",
            "cpu": {"model": results.cpu.model, "flags": results.cpu.flags,
                    "cpus": results.cpus},
            "peers": results.peers, "kernel_isa": results.kernel_isa,
            "failed": results.failed, "summary": peers_summary(results)}


def _isa_cell(row: dict[str, Any]) -> str:
    names = sorted({sample.get("isa", "?") for sample in row["kernel_isa"]})
    return ", ".join(names) if names else "-"


def first_and_last(text: str) -> str:
    """The first and last non-blank lines of `text` (an error and the end of its log)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)


def _across(runs: dict[int, dict[str, Any]], levels: tuple[int, ...],
            pick: Callable[[dict[str, Any]], str]) -> str:
    """One cell: `pick` of each concurrency's figures, joined by " / "."""
    return " / ".join(pick(runs[c]) if c in runs else "-" for c in levels)


def _ms_of(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda figures: ms_cell(figures[key])


def _ratio_to(reference: str) -> Callable[[dict[str, Any]], str]:
    def cell(figures: dict[str, Any]) -> str:
        value = figures["vs"].get(reference)
        return "-" if value is None else f"{value:.2f}x"
    return cell


def peers_markdown(results: PeersResults) -> str:
    """The CPU, one row per target (tokens/s at each concurrency, p50 latencies, ratios to
    each peer), how the peers ran, failures, then serve's table of every run."""
    levels = results.concurrencies()
    across = " / ".join(f"c={c}" for c in levels)
    references = results.references()
    header = ["target", *(f"output tok/s c={c}" for c in levels),
              f"TTFT p50 (ms) {across}", f"ITL p50 (ms) {across}", f"TPOT p50 (ms) {across}",
              f"prompt tokens p50 {across}",
              *(f"tok/s vs {ref} {across}" for ref in references), "kernel ISA"]
    rows = []
    for row in peers_summary(results):
        runs = row["runs"]
        tokens = [runs.get(c, {}).get("output_tokens_per_s") for c in levels]
        rows.append([
            row["label"], *("-" if t is None else f"{t:.1f}" for t in tokens),
            *(_across(runs, levels, _ms_of(key))
              for key in ("ttft_p50_s", "itl_p50_s", "tpot_p50_s")),
            _across(runs, levels, lambda r: "-" if r["prompt_tokens_p50"] is None
                    else f"{r['prompt_tokens_p50']:.0f}"),
            *(_across(runs, levels, _ratio_to(ref)) for ref in references),
            _isa_cell(row)])
    serve = results.serve
    cpu = results.cpu
    title = (f"Peers side by side: workload {serve.workload.name}, {serve.num_requests} "
             f"requests per run, {serve.workload.output_len} output tokens each, greedy, "
             f"ignore_eos")
    machine = (f"CPU: {cpu.model}, CPUs {results.cpus} for every target; "
               f"flags: {' '.join(cpu.simd()) or '-'}")
    how = [f"- {label}: {info.version}, serving {info.serves}: `{' '.join(info.command)}`"
           + (f" with {' '.join(f'{k}={v}' for k, v in info.env.items())}" if info.env else "")
           for label, info in results.peers.items()]
    failed = [f"- {label} FAILED: {first_and_last(why)}"
              for label, why in results.failed.items()]
    parts = [title, machine, table(header, rows), "\n".join(how + failed)]
    if serve.targets:
        parts.append(serve_markdown(serve))
    return "\n\n".join(part for part in parts if part)
