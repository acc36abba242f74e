"""`goodput`: DistServe-style SLO goodput of disaggregated against colocated serving, same CPUs.

Each mode is launched in turn (launch.sh pins its workers; see MODES). First, single requests of
a few prompt lengths, one at a time, give the mode's unloaded latencies: TTFT at each length,
and TPOT. Then each workload is swept over Poisson arrival rates, the same
requests at the same arrival times for every mode, with fresh prompts for every run (no prefix
cache carry-over). A mode's sweep of a workload stops early after a rate, at or above the
comparison rate, at which it is saturated: under half its requests within twice its own
unloaded-derived SLO.

After every mode has run, one SLO is set from the median of the modes' unloaded figures (TTFT
`--ttft-factor` times the unloaded TTFT at the prompt's length, interpolated between the probed
lengths, so long prompts get a longer budget and short ones are not held to a line fitted to the
long ones; TPOT
`--tpot-factor` times the unloaded TPOT), and every run is judged against it: SLO attainment,
goodput (the rate where attainment falls below 90 %, interpolated between swept rates), p99 TTFT
and p99 TPOT. Output: results.json, results.md, attainment.png and tpot_cdf.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from autoscaler.pools import Bounds
from bench import steps
from bench.client import served_model
from bench.goodput_results import (
    GoodputPlan,
    GoodputResults,
    ModeRun,
    RateRun,
    Unloaded,
    samples,
)
from bench.launcher import ROOT, launched, model_dir
from bench.load import Load, LoadRun, run_load
from bench.modes import LOOSE, MODES, probe_specs, probe_unloaded, request_timeout
from bench.plots import plot_attainment, plot_tpot_cdfs
from bench.prompts import PromptMaker, TokenPrompts
from bench.report import goodput_json, goodput_markdown, write_json
from bench.serve import open_client
from bench.stats import Slo, attainment
from bench.workloads import RequestSpec, Workload, build

GOODPUT_WORKLOADS = ("chat", "humaneval", "mixed")
# Rates (req/s) per workload for the SmolLM2-135M on 2 CPU cores in bf16 (~1,800 prompt tokens/s
# per core; fp32: ~450): humaneval prompts are short (~130 tokens), chat ~275 tokens on average,
# mixed ~460 (7 % of 2,000-4,000 tokens). A sweep stops early once a mode is saturated.
DEFAULT_RATES = {"chat": (1.0, 2.0, 3.0, 4.0, 6.0), "humaneval": (1.0, 2.0, 3.0, 4.0, 6.0),
                 "mixed": (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)}
QUICK_RATES = {"chat": (1.0, 3.0), "humaneval": (2.0, 4.0), "mixed": (0.5, 1.5)}
SWEEP_S, STEP_S = 15.0, 40.0  # seconds of arrivals per rate; per phase of --autoscale's load
SATURATED = 0.5  # attainment under LOOSE x a mode's own SLO below which its sweep stops


def rate_specs(plan: GoodputPlan,
               prompts: PromptMaker) -> dict[tuple[str, float], list[RequestSpec]]:
    """The requests of every (workload, rate): seeded per rate, prompts numbered apart."""
    specs: dict[tuple[str, float], list[RequestSpec]] = {}
    first = len(plan.probe_lens) + 1
    for workload in plan.workloads:
        for k, rate in enumerate(plan.rates[workload.name]):
            count = plan.request_count(rate)
            seeded = dataclasses.replace(workload, seed=workload.seed + k)
            specs[workload.name, rate] = build(seeded, prompts, count, first)
            first += count
    return specs


def saturated(slo: Slo, run: LoadRun) -> bool:
    """Whether under half the run's requests met LOOSE x `slo`: higher rates are pointless."""
    return not attainment(slo.scaled(LOOSE), samples(run)) >= SATURATED


@dataclass(frozen=True)
class Session:
    """What one mode's measurement needs besides its server."""

    mode: str
    plan: GoodputPlan
    specs: Mapping[tuple[str, float], Sequence[RequestSpec]]
    probes: Sequence[RequestSpec]
    step: Callable[[int], object]  # advances the progress bar


async def _sweep(client: httpx.AsyncClient, model: str, session: Session, workload: Workload,
                 own: Slo) -> list[RateRun]:
    """`workload` at rising rates, until saturated above the comparison rate."""
    rates = session.plan.rates[workload.name]
    runs = []
    for k, rate in enumerate(rates):
        requests = session.specs[workload.name, rate]
        load = Load(rate=rate, request_timeout_s=request_timeout(own, requests),
                    seed=workload.seed + k)
        label = f"{session.mode} {workload.name} @ {rate:g}/s"
        run = await run_load(client, model, requests, load, label)
        runs.append(RateRun(workload.name, rate, load, run))
        session.step(1)
        if rate >= session.plan.compare_rates[workload.name] and saturated(own, run):
            session.step(len(rates) - k - 1)
            break
    return runs


async def _measure(url: str, session: Session) -> tuple[Unloaded, tuple[RateRun, ...]]:
    async with open_client(url, None, 600.0) as client:
        model = await served_model(client)
        unloaded = await probe_unloaded(client, model, session.probes)
        session.step(1)
        own = unloaded.slo(session.plan.ttft_factor, session.plan.tpot_factor)
        runs = []
        for workload in session.plan.workloads:
            runs += await _sweep(client, model, session, workload, own)
    return unloaded, tuple(runs)


def measure_mode(session: Session) -> ModeRun:
    """Launch `session.mode`, measure it, stop it."""
    flags = MODES[session.mode]
    with launched(flags) as server:
        unloaded, runs = asyncio.run(_measure(server.url, session))
    return ModeRun(session.mode, flags, str(server.run_dir), unloaded, runs)


def run_modes(plan: GoodputPlan, prompts: PromptMaker) -> tuple[list[ModeRun], dict[str, str]]:
    """Every mode in turn, under one progress bar; a mode that fails is reported, not fatal."""
    specs = rate_specs(plan, prompts)
    probes = probe_specs(prompts, plan.probe_lens)
    per_mode = 1 + sum(len(plan.rates[w.name]) for w in plan.workloads)
    measured, failed = [], {}
    with tqdm(total=per_mode * len(plan.modes), desc="goodput", unit="run") as bar:
        for mode in plan.modes:
            bar.set_postfix_str(mode)
            session = Session(mode, plan, specs, probes, bar.update)
            try:
                measured.append(measure_mode(session))
            except (RuntimeError, TimeoutError, httpx.HTTPError, ValueError) as error:
                failed[mode] = f"{type(error).__name__}: {error}"
                print(f"[bench] {mode} failed: {failed[mode]}", file=sys.stderr)
            bar.update(per_mode * (len(measured) + len(failed)) - bar.n)
    return measured, failed


def _floats(text: str) -> tuple[float, ...]:
    return tuple(sorted(float(part) for part in text.split(",") if part.strip()))


def _names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return names
    return parse


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `goodput` subcommand's flags."""
    parser = commands.add_parser("goodput", help="SLO goodput: disaggregated vs colocated",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--autoscale", metavar="MIN:MAX", default=None,
                        help="instead of the sweeps: a step load (chats, long prompts, chats; "
                             "--rates CHAT,LONG, default 2,0.3) against fixed 1P+1D, fixed "
                             "coloc-1x2, and 1P+1D autoscaled between MIN and MAX workers a pool")
    parser.add_argument("--modes", type=_names(tuple(MODES)), default=tuple(MODES),
                        help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--workloads", type=_names(GOODPUT_WORKLOADS),
                        help="comma-separated (default: chat,humaneval,mixed; --quick: mixed)")
    parser.add_argument("--rates", type=_floats, metavar="R1,R2,...",
                        help="req/s for every workload (default: per workload, see the docs)")
    parser.add_argument("--compare-rate", type=float,
                        help="the rate of the TPOT CDFs and p99 comparison, run by every mode "
                             "(default: each workload's second rate)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of arrivals per rate (default 15; --autoscale: per "
                             "phase, default 40)")
    parser.add_argument("--min-requests", type=int, help="per rate (default 10; --quick 8)")
    parser.add_argument("--output-len", type=int, default=48,
                        help="humaneval: output tokens; chat, mixed: the cap on their outputs")
    parser.add_argument("--long-share", type=float, default=0.07,
                        help="mixed: share of 2,000-4,000-token prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-factor", type=float, default=5.0,
                        help="TTFT SLO in multiples of the unloaded TTFT for the prompt length")
    parser.add_argument("--tpot-factor", type=float, default=2.0,
                        help="TPOT SLO in multiples of the unloaded TPOT")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a few minutes: mixed only, 2 rates")
    parser.add_argument("--out", type=Path, help="folder for results.json, results.md and the "
                                                 "PNGs (default runs/goodput-TIME/)")
    parser.set_defaults(prepare=prepare)


def make_plan(args: argparse.Namespace) -> GoodputPlan:
    """The plan the flags describe (with --quick's smaller defaults)."""
    names = args.workloads or (("mixed",) if args.quick else GOODPUT_WORKLOADS)
    defaults = QUICK_RATES if args.quick else DEFAULT_RATES
    rates = {name: args.rates or defaults[name] for name in names}
    if args.compare_rate is not None:
        rates = {name: tuple(sorted({*r, args.compare_rate})) for name, r in rates.items()}
    compare = {name: args.compare_rate or r[min(1, len(r) - 1)] for name, r in rates.items()}
    workloads = tuple(Workload(name, output_len=args.output_len, long_share=args.long_share,
                               seed=args.seed, max_output_len=args.output_len)
                      for name in names)
    return GoodputPlan(args.modes, workloads, rates, compare, duration_s=args.duration or SWEEP_S,
                       min_requests=args.min_requests or (8 if args.quick else 10),
                       ttft_factor=args.ttft_factor, tpot_factor=args.tpot_factor)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    """Check the flags and build the plan; the returned job measures every mode."""
    if args.rates is not None and (not args.rates or min(args.rates) <= 0):
        raise ValueError("--rates must be positive")
    if min(args.output_len, args.min_requests or 1) < 1 or (args.duration or 1) <= 0:
        raise ValueError("--output-len, --min-requests and --duration must be positive")
    out = args.out or ROOT / "runs" / f"goodput-{time.strftime('%Y%m%d-%H%M%S')}"
    command = ("python -m bench", *argv)
    if args.autoscale is not None:
        Bounds.parse(args.autoscale)  # ValueError with the reason
        chat_rate, long_rate = args.rates if args.rates and len(args.rates) == 2 else (2.0, 0.3)
        duration = args.duration or STEP_S
        return lambda: steps.run(args.autoscale, duration, chat_rate, long_rate,
                                 args.output_len, command, out)
    plan = make_plan(args)
    return lambda: run(plan, command, out)


def run(plan: GoodputPlan, command: tuple[str, ...], out: Path) -> int:
    """Measure every mode; write results.json, results.md and the PNGs; print the Markdown."""
    folder = model_dir(MODES[plan.modes[0]])
    measured, failed = run_modes(plan, TokenPrompts(folder))
    if not measured:
        print("[bench] no mode could be measured", file=sys.stderr)
        return 1
    results = GoodputResults(command, plan, f"token ids (tokenizer {folder})",
                             tuple(measured), failed)
    write_json(goodput_json(results), out / "results.json")
    markdown = goodput_markdown(results)
    (out / "results.md").write_text(markdown + "\n")
    plot_attainment(results, out / "attainment.png")
    plot_tpot_cdfs(results, out / "tpot_cdf.png")
    print(markdown)
    print(f"\nwrote {out}/results.json, results.md, attainment.png, tpot_cdf.png",
          file=sys.stderr)
    return int(bool(failed))
