"""`goodput --autoscale MIN:MAX`: a load that steps from short chats to long prompts and back,
sent in turn to fixed layouts and to one whose pools autoscale (launch.sh --autoscale), each
judged against one SLO (goodput's: the factors times the median of the layouts' unloaded
latencies). Reports SLO attainment per phase and over the whole load, and the pools' sizes as
the autoscaled layout ran them. Output: steps.json, steps.md and steps.png."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from matplotlib.figure import Figure

from bench.client import served_model
from bench.goodput_results import PROBE_LENS, Unloaded, reference_slo, samples
from bench.launcher import launched, model_dir
from bench.load import Load, LoadRun, run_load
from bench.modes import MODES, probe_specs, probe_unloaded, request_timeout
from bench.prompts import PromptMaker, TokenPrompts
from bench.report import write_json
from bench.serve import open_client
from bench.stats import Slo, attainment, percentile
from bench.workloads import RequestSpec, Workload, build


@dataclass(frozen=True)
class Phase:
    """Poisson arrivals of one workload at one rate for `duration_s`."""

    name: str
    workload: Workload
    rate: float
    duration_s: float


def phases(duration_s: float, chat_rate: float, long_rate: float,
           output_len: int) -> tuple[Phase, ...]:
    """Short chats, then long prompts (2,000-4,000 tokens each), then short chats again."""
    chat = Workload("chat", output_len=output_len, max_output_len=output_len)
    long = Workload("mixed", output_len=output_len, long_share=1.0, seed=1)
    return (Phase("chat", chat, chat_rate, duration_s),
            Phase("long prompts", long, long_rate, duration_s),
            Phase("chat again", dataclasses.replace(chat, seed=2), chat_rate, duration_s))


def layouts(bounds: str) -> dict[str, tuple[str, ...]]:
    """The fixed layouts compared, and the autoscaled one (from 1 prefill + 1 decode)."""
    modes = MODES
    return {"fixed 1P+1D": modes["conditional"], "fixed coloc-1x2": modes["coloc-1x2"],
            f"autoscale {bounds}": (*modes["conditional"], "--autoscale", bounds)}


@dataclass(frozen=True)
class LayoutRun:
    name: str
    flags: tuple[str, ...]
    unloaded: Unloaded
    runs: tuple[LoadRun, ...]  # one per phase
    pools: tuple[tuple[float, int, int], ...]  # (seconds into the load, prefill, decode)


async def _watch_pools(client: httpx.AsyncClient, started: float,
                       into: list[tuple[float, int, int]]) -> None:
    """The serving pools' sizes once a second, until cancelled."""
    while True:
        health = (await client.get("/health")).json()
        into.append((time.monotonic() - started, health["prefill"], health["decode"]))
        await asyncio.sleep(1.0)


async def _measure(url: str, specs: Sequence[Sequence[RequestSpec]], plan: Sequence[Phase],
                   probes: Sequence[RequestSpec]) -> tuple[Unloaded, list[LoadRun],
                                                           list[tuple[float, int, int]]]:
    async with open_client(url, None, 900.0) as client:
        model = await served_model(client)
        unloaded = await probe_unloaded(client, model, probes)
        own = unloaded.slo(5.0, 2.0)
        pools: list[tuple[float, int, int]] = []
        watcher = asyncio.create_task(_watch_pools(client, time.monotonic(), pools))
        runs = []
        try:
            for phase, requests in zip(plan, specs, strict=True):
                load = Load(rate=phase.rate, duration_s=phase.duration_s,
                            request_timeout_s=request_timeout(own, requests))
                runs.append(await run_load(client, model, requests, load, phase.name))
        finally:
            watcher.cancel()
    return unloaded, runs, pools


def measure(plan: Sequence[Phase], bounds: str, prompts: PromptMaker) -> list[LayoutRun]:
    """Every layout in turn, the same requests at the same arrival times."""
    probes = probe_specs(prompts, PROBE_LENS)
    first, specs = len(probes), []
    for phase in plan:
        count = max(4, round(phase.rate * phase.duration_s * 1.2))
        specs.append(build(phase.workload, prompts, count, first))
        first += count
    measured = []
    for name, flags in layouts(bounds).items():
        with launched(flags) as server:
            unloaded, runs, pools = asyncio.run(_measure(server.url, specs, plan, probes))
        measured.append(LayoutRun(name, flags, unloaded, tuple(runs), tuple(pools)))
    return measured


def summary(slo: Slo, run: LoadRun) -> dict[str, float]:
    """Requests, SLO attainment, p99 TTFT and TPOT (ms) of one run."""
    ttfts = [r.ttft_s for r in run.results if r.ttft_s is not None]
    tpots = [t for r in run.results if (t := r.tpot_s) is not None]
    return {"requests": len(run.results), "attainment": attainment(slo, samples(run)),
            "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else float("nan"),
            "tpot_p99_ms": percentile(tpots, 99) * 1000 if tpots else float("nan")}


def report(plan: Sequence[Phase], measured: Sequence[LayoutRun], slo: Slo) -> str:
    """The Markdown table: attainment per phase and over the whole load, per layout."""
    lines = ["| layout | " + " | ".join(p.name for p in plan) + " | whole load |",
             "|---" * (len(plan) + 2) + "|"]
    for layout in measured:
        cells = []
        for run in layout.runs:
            s = summary(slo, run)
            cells.append(f"{100 * s['attainment']:.0f} % (p99 TTFT {s['ttft_p99_ms']:.0f} ms, "
                         f"TPOT {s['tpot_p99_ms']:.0f} ms)")
        every = [x for run in layout.runs for x in samples(run)]
        cells.append(f"{100 * attainment(slo, every):.0f} %")
        lines.append(f"| {layout.name} | " + " | ".join(cells) + " |")
    phases_text = ", ".join(f"{p.name} at {p.rate:g} req/s for {p.duration_s:g} s" for p in plan)
    return "\n".join([f"Step load: {phases_text}. SLO: TTFT within {slo.ttft_s * 1000:.0f} ms "
                      f"at the shortest prompts (longer ones more, as unloaded), TPOT "
                      f"{slo.tpot_s * 1000:.0f} ms.", "", *lines])


def plot(plan: Sequence[Phase], measured: Sequence[LayoutRun], slo: Slo, path: Path) -> None:
    """Attainment per phase per layout, and the autoscaled layout's pools over time."""
    figure = Figure(figsize=(12, 4))
    bars, sizes = figure.subplots(1, 2)
    width = 0.8 / len(measured)
    for k, layout in enumerate(measured):
        values = [100 * summary(slo, run)["attainment"] for run in layout.runs]
        bars.bar([i + k * width for i in range(len(plan))], values, width, label=layout.name)
        if len({(p, d) for _, p, d in layout.pools}) > 1:  # only pools that changed size
            times = [t for t, _, _ in layout.pools]
            sizes.step(times, [p for _, p, _ in layout.pools], where="post",
                       label=f"{layout.name}: prefill")
            sizes.step(times, [d for _, _, d in layout.pools], where="post",
                       label=f"{layout.name}: decode")
    for end in itertools.accumulate(p.duration_s for p in plan[:-1]):
        sizes.axvline(end, color="grey", linestyle=":")
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(plan))], [p.name for p in plan])
    bars.set(ylabel="% of requests within SLO", ylim=(0, 105), title="SLO attainment per phase")
    sizes.set(xlabel="seconds into the load (dotted: the phases' ends)",
              ylabel="serving workers", title="pool sizes that changed")
    for axes in (bars, sizes):
        axes.legend(fontsize="x-small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def run(bounds: str, duration_s: float, chat_rate: float, long_rate: float, output_len: int,
        command: tuple[str, ...], out: Path) -> int:
    """Measure every layout under the step load; write and print the results."""
    plan = phases(duration_s, chat_rate, long_rate, output_len)
    folder = model_dir(MODES["conditional"])
    measured = measure(plan, bounds, TokenPrompts(folder))
    slo = reference_slo([m.unloaded for m in measured], 5.0, 2.0)
    markdown = report(plan, measured, slo)
    write_json({"command": list(command), "slo": dataclasses.asdict(slo),
                "layouts": [{"name": m.name, "flags": list(m.flags),
                             "phases": [summary(slo, r) for r in m.runs],
                             "pools": [list(p) for p in m.pools]} for m in measured]},
               out / "steps.json")
    (out / "steps.md").write_text(markdown + "\n")
    plot(plan, measured, slo, out / "steps.png")
    print(markdown)
    print(f"\nwrote {out}/steps.json, steps.md, steps.png", file=sys.stderr)
    return 0
