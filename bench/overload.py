"""`overload`: what admission control does for the requests it admits during a flood.

One launched server, capped at `cap` requests in flight (`gateway.max_inflight_requests`),
gets three loads in a row, with the same kind of request:
- idle: one request at a time;
- rated: `cap` closed-loop streams, the most it admits (every request gets in, none waits
  beyond the cap); its throughput is what the server can serve;
- flood: Poisson arrivals at `factor` times that throughput for `flood_s` seconds. Requests
  over the cap get 429 at once; the admitted ones should see the rated latency, not a queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench.client import served_model
from bench.launcher import ROOT, launched, model_dir
from bench.load import Load, run_load, warm_up
from bench.prompts import TokenPrompts
from bench.stats import Slo
from bench.summary import Summary, summarize
from bench.workloads import RequestSpec, Workload, build


@dataclass(frozen=True)
class OverloadPlan:
    launch_flags: tuple[str, ...]
    cap: int  # requests in flight the gateway admits
    input_len: int
    output_len: int
    idle_requests: int
    rated_requests: int
    factor: float  # the flood's arrival rate, in multiples of the rated throughput
    flood_s: float
    seed: int = 0


@dataclass(frozen=True)
class Phase:
    name: str
    load: Load
    summary: Summary


def capped_config(cap: int, out: Path) -> Path:
    """configs/default.yaml with the in-flight cap set to `cap`, written to `out`."""
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config["gateway"]["max_inflight_requests"] = cap
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(config))
    return out


def run(plan: OverloadPlan, config_path: Path) -> list[Phase]:
    """Launch the capped server, run idle, rated and flood, and stop it."""
    flags = (*plan.launch_flags, "--config", str(capped_config(plan.cap, config_path)))
    prompts = TokenPrompts(model_dir(flags))
    workload = Workload("fixed", plan.input_len, plan.output_len, seed=plan.seed)
    flood_count = int(plan.factor * plan.flood_s * 50) + 20  # above any rate this sustains
    specs = build(workload, prompts, 2 + plan.idle_requests + plan.rated_requests + flood_count)
    with launched(flags) as server:
        return asyncio.run(_phases(server.url, plan, specs))


async def _phases(url: str, plan: OverloadPlan, specs: Sequence[RequestSpec]) -> list[Phase]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        model = await served_model(client)
        await warm_up(client, model, specs[:2], Load(concurrency=2))
        rest = specs[2:]
        idle = await _phase(client, model, "idle", Load(concurrency=1),
                            rest[:plan.idle_requests])
        rest = rest[plan.idle_requests:]
        rated = await _phase(client, model, "rated", Load(concurrency=plan.cap),
                             rest[:plan.rated_requests])
        rate = plan.factor * rated.summary.requests_per_s
        flood_load = Load(rate=rate, duration_s=plan.flood_s, seed=plan.seed)
        expected = int(rate * plan.flood_s * 1.3) + 20  # Poisson: room above the mean
        flood = await _phase(client, model, f"flood {plan.factor:g}x", flood_load,
                             rest[plan.rated_requests:plan.rated_requests + expected])
    return [idle, rated, flood]


async def _phase(client: httpx.AsyncClient, model: str, name: str, load: Load,
                 specs: Sequence[RequestSpec]) -> Phase:
    run = await run_load(client, model, specs, load, name)
    return Phase(name, load, summarize(run, Slo(ttft_s=1e9, tpot_s=1e9)))


def markdown(phases: Sequence[Phase]) -> str:
    """The table: per phase, what was sent and admitted and the admitted requests' latency,
    with the flood's p99 as a ratio of the rated one."""
    rated = next(p for p in phases if p.name == "rated").summary
    lines = ["| load | arrivals | sent | admitted | 429 | e2e p50 s | e2e p99 s | TTFT p99 s "
             "| TPOT p50 ms | e2e p99 / rated | TTFT p99 / rated |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for phase in phases:
        s = phase.summary
        arrivals = (f"closed loop, {phase.load.concurrency} at a time" if phase.load.rate is None
                    else f"{phase.load.rate:.1f}/s Poisson")
        lines.append(
            f"| {phase.name} | {arrivals} | {s.completed + s.failed} | {s.completed} "
            f"| {s.errors.get('HTTP 429', 0)} | {s.e2e_s.p50:.2f} | {s.e2e_s.p99:.2f} "
            f"| {s.ttft_s.p99:.2f} | {s.tpot_s.p50 * 1000:.0f} "
            f"| {s.e2e_s.p99 / rated.e2e_s.p99:.2f}x | {s.ttft_s.p99 / rated.ttft_s.p99:.2f}x |")
    other = {k: v for p in phases for k, v in p.summary.errors.items() if k != "HTTP 429"}
    if other:
        lines.append(f"\nother failures: {other}")
    return "\n".join(lines)


def as_json(plan: OverloadPlan, phases: Sequence[Phase]) -> dict[str, object]:
    return {"plan": dataclasses.asdict(plan),
            "phases": [{"name": p.name, "load": dataclasses.asdict(p.load),
                        "summary": dataclasses.asdict(p.summary)} for p in phases]}
