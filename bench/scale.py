"""`python -m bench scale`: the control plane at scales real models cannot reach on two cores,
with simulated workers (`--model sim`, engine/sim) behind the real gateway, channels and KV.

Scenarios (each launches its own cluster; `all` runs them one after the other):
- `streams`: 2 prefill + 6 decode workers, N concurrent streams (1,000 of 200 tokens by
  default), every token checked; then an abort storm of N requests dropped at every phase
  (every worker must come back to no block, sequence or transfer held); then N streams again
  with the busiest decode worker killed midway (every stream must still be right).
- `relay`: the gateway pinned to one CPU, everything else to the other, simulated steps of no
  time: SSE tokens per second the gateway relays, its CPU use, memory and open files, per
  stream and in total.
- `routing`: the gateway's routing alone, in this process, over 8, 64 and 256 registered
  workers: the CPU time of one decision.
- `workers`: many workers (64 by default, a quarter of them prefill) registered at once: time
  to register, heartbeats per second, and the CPU time of each routing decision (the
  gateway's `raging_route_seconds`) over a burst of 8 short requests per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.launcher import LaunchedServer, launched
from bench.report import write_json
from bench.sim_streams import (
    SimRequest,
    StreamsSummary,
    abort_storm,
    run_streams,
    sim_requests,
    summarize,
)
from core.config import GatewayConfig, Role
from core.messages import Heartbeat, Register
from core.pids import started_pids
from engine.kernels.isa import cpu_summary
from engine.sim.profile import load_profile
from gateway.__main__ import make_registry, make_router
from gateway.routing import Router

SCENARIOS = ("streams", "relay", "workers", "routing")
_TAIL_BYTES = 1024  # a stream's last events: its usage and [DONE]
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens": ?(\d+)')
MB = 1024 * 1024


@dataclass(frozen=True)
class ScalePlan:
    streams: int
    output_len: int
    prefill: int
    decode: int
    kv_bytes: float
    relay_streams: int
    relay_output_len: int
    workers: int
    burst: int  # workers: requests sent at once (0: 8 per worker)
    burst_output_len: int
    profile: str


def sim_flags(profile: str, prefill: int, decode: int, *settings: str) -> list[str]:
    """launch.sh flags for a simulated cluster with room for thousands of streams."""
    model = "sim" if profile == "default" else f"sim:{profile}"
    flags = ["--model", model, "--prefill", str(prefill), "--decode", str(decode)]
    for setting in ("gateway.max_inflight_requests=8192", "gateway.max_queued_tokens=4000000",
                    "gateway.progress_timeout_s=600", "decode.max_running=256",
                    "prefill.num_kv_blocks=16384", "decode.num_kv_blocks=16384",
                    "prefill.prefix_caching=false", "decode.prefix_caching=false", *settings):
        flags += ["--set", setting]
    return flags


def metrics(url: str) -> dict[str, float]:
    """Every sample of the gateway's /metrics, keyed `name{label="value",...}`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def served_model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])


def held(url: str) -> dict[str, float]:
    """What workers still hold (blocks, sequences, transfers) and requests in flight; empty
    when nothing is."""
    kinds = ("raging_kv_blocks_used", "raging_worker_running", "raging_worker_waiting",
             "raging_kv_in_transfer", "raging_requests_inflight")
    return {k: v for k, v in metrics(url).items() if k.startswith(kinds) and v}


def settle(url: str, timeout_s: float = 60) -> tuple[float, dict[str, float]]:
    """Seconds until nothing is held (or `timeout_s`), and what is still held then."""
    began = time.monotonic()
    while (left := held(url)) and time.monotonic() - began < timeout_s:
        time.sleep(0.5)
    return time.monotonic() - began, left


def process_use(pid: int) -> dict[str, float]:
    process = psutil.Process(pid)
    cpu = process.cpu_times()
    return {"rss_mb": process.memory_info().rss / MB, "fds": process.num_fds(),
            "cpu_s": cpu.user + cpu.system}


def timed_streams(url: str, model: str, requests: list[SimRequest], mean: int,
                  during: Callable[[], None] | None = None) -> StreamsSummary:
    """Stream every request at once (calling `during` from a thread meanwhile)."""
    async def go() -> list[Any]:
        streams = asyncio.create_task(run_streams(url, model, requests))
        if during is not None:
            await asyncio.to_thread(during)
        return await streams
    began = time.monotonic()
    outcomes = asyncio.run(go())
    return summarize(requests, outcomes, time.monotonic() - began, mean)


def streams_scenario(plan: ScalePlan) -> dict[str, Any]:
    mean = load_profile(plan.profile).mean_output_tokens
    flags = sim_flags(plan.profile, plan.prefill, plan.decode, f"sim.kv_bytes={plan.kv_bytes}",
                      "kv_transfer.buffer_mb=256")
    with launched(flags) as server:
        model, gateway = served_model(server.url), started_pids(server.run_dir)["gateway"]
        result: dict[str, Any] = {"layout": f"{plan.prefill}P+{plan.decode}D",
                                  "gateway_at_rest": process_use(gateway)}
        with Peak(gateway) as peak:
            result["streams"] = asdict(timed_streams(
                server.url, model, sim_requests(plan.streams, plan.output_len, seed=1), mean))
        rest = result["gateway_at_rest"]
        result["gateway_peak"] = peak.most
        result["gateway_per_stream"] = {
            "rss_kb": (peak.most["rss_mb"] - rest["rss_mb"]) * 1024 / plan.streams,
            "fds": (peak.most["fds"] - rest["fds"]) / plan.streams}
        result["abort_storm"] = _storm(server.url, model, plan)
        result["kill"] = _kill(server, model, plan, mean)
        result["route"] = route_times(server.url)
        return result


def _storm(url: str, model: str, plan: ScalePlan) -> dict[str, Any]:
    requests = sim_requests(plan.streams, plan.output_len, seed=2)
    began = time.monotonic()
    seen = asyncio.run(abort_storm(url, model, requests, plan.streams))
    settle_s, left = settle(url)
    return {"requests": len(requests), "clients_saw": dict(seen),
            "seconds": time.monotonic() - began, "settled_s": settle_s, "left_held": left,
            "aborts_sent": metrics(url).get("raging_aborts_sent_total", 0)}


def _kill(server: LaunchedServer, model: str, plan: ScalePlan, mean: int) -> dict[str, Any]:
    killed: dict[str, Any] = {}

    def kill_busiest() -> None:
        time.sleep(2.0)
        running = {k: v for k, v in metrics(server.url).items()
                   if k.startswith('raging_worker_running{worker="decode')}
        busiest = max(running, key=lambda k: running[k])
        worker = busiest.split('"')[1]
        os.kill(started_pids(server.run_dir)[worker], signal.SIGKILL)
        killed.update(worker=worker, running=running[busiest], at_s=time.monotonic() - began)

    requests = sim_requests(plan.streams, plan.output_len, seed=3)
    began = time.monotonic()
    summary = timed_streams(server.url, model, requests, mean, kill_busiest)
    return {"killed": killed, "streams": asdict(summary),
            "resumed": metrics(server.url).get("raging_requests_resumed_total", 0),
            "settled": settle(server.url)}


def route_times(url: str) -> dict[str, float]:
    """Routing decisions so far: count, mean and the p99 bucket's upper bound, in µs."""
    return route_summary(metrics(url))


def route_summary(samples: dict[str, float]) -> dict[str, float]:
    count = samples.get("raging_route_seconds_count", 0)
    buckets = sorted((float(k.split('le="')[1].rstrip('"}')), v) for k, v in samples.items()
                     if k.startswith("raging_route_seconds_bucket"))
    p99 = next((le for le, below in buckets if below >= 0.99 * count), float("inf"))
    mean_s = samples.get("raging_route_seconds_sum", 0) / max(count, 1)
    return {"decisions": count, "mean_us": mean_s * 1e6, "p99_at_most_us": p99 * 1e6,
            "decisions_per_cpu_s": 1 / mean_s if mean_s else float("nan")}


@contextmanager
def pinned(pids: Sequence[int], gateway: int) -> Iterator[bool]:
    """The gateway alone on the first CPU, `pids` and this process on the others (False,
    nothing pinned, with one CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield False
        return
    rest = set(cpus[1:])
    os.sched_setaffinity(gateway, {cpus[0]})
    for pid in [*pids, 0]:
        os.sched_setaffinity(pid, rest)
    try:
        yield True
    finally:
        os.sched_setaffinity(0, set(cpus))


async def _count_events(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, int]:
    """(SSE events, tokens its usage reports) of one stream, counted as bytes arrive (the
    client must not be what limits the gateway); (-1, 0) if it did not end with [DONE]."""
    events, tail = 0, b""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for chunk in response.aiter_bytes():
            data = tail + chunk
            events += data.count(b"data: ") - tail.count(b"data: ")
            tail = data[-_TAIL_BYTES:]
    usage = _COMPLETION_TOKENS.search(tail)
    if not tail.rstrip().endswith(b"[DONE]") or usage is None:
        return -1, 0
    return events, int(usage.group(1))


def relay_scenario(plan: ScalePlan) -> dict[str, Any]:
    """One decode worker with a full batch: the fewest processes beside the gateway's CPU."""
    flags = sim_flags(plan.profile, 1, 1, "sim.time_scale=0", "sim.kv_bytes=0.05")
    requests = sim_requests(plan.relay_streams, plan.relay_output_len, seed=4,
                            prompt_lens=(16, 32))
    with launched(flags) as server:
        model, pids = served_model(server.url), started_pids(server.run_dir)
        gateway = pids.pop("gateway")
        with pinned(list(pids.values()), gateway) as alone, Peak(gateway) as peak:
            before, began = process_use(gateway), time.monotonic()
            counted = asyncio.run(_relay(server.url, model, requests))
            wall = time.monotonic() - began
            after = process_use(gateway)
    complete = [(n, tokens) for n, tokens in counted if tokens == plan.relay_output_len]
    tokens = sum(tokens for _, tokens in complete)
    cpu = after["cpu_s"] - before["cpu_s"]
    streams = len(requests)
    return {"streams": streams, "complete": len(complete), "gateway_alone_on_a_cpu": alone,
            "tokens": tokens, "events": sum(n for n, _ in complete), "wall_s": wall,
            "tokens_per_s": tokens / wall, "gateway_cpu_s": cpu, "gateway_cpu_share": cpu / wall,
            "tokens_per_gateway_cpu_s": tokens / cpu if cpu else float("nan"),
            "gateway_at_rest": before, "gateway_peak": peak.most,
            "per_stream": {"rss_kb": (peak.most["rss_mb"] - before["rss_mb"]) * 1024 / streams,
                           "fds": (peak.most["fds"] - before["fds"]) / streams}}


class Peak:
    """The most memory and open files a process had while the block ran (sampled)."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s = pid, every_s
        self.most = {"rss_mb": 0.0, "fds": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            use = process_use(self.pid)
            self.most = {k: max(self.most[k], use[k]) for k in self.most}


async def _relay(url: str, model: str, requests: list[SimRequest]) -> list[tuple[int, int]]:
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(_count_events(client, r.body(model, usage=True))
                                           for r in requests)))


def workers_scenario(plan: ScalePlan) -> dict[str, Any]:
    prefill = max(1, plan.workers // 4)
    flags = sim_flags(plan.profile, prefill, plan.workers - prefill, "sim.kv_bytes=0.05",
                      "prefill.num_kv_blocks=2048", "decode.num_kv_blocks=2048")
    began = time.monotonic()
    with launched(flags, timeout_s=900) as server:
        registered_s = time.monotonic() - began
        beats = _beats_per_s(server.url, 10.0)
        model = served_model(server.url)
        requests = sim_requests(plan.burst or plan.workers * 8, plan.burst_output_len, seed=5,
                                prompt_lens=(16, 64))
        burst_began = time.monotonic()
        outcomes = asyncio.run(run_streams(server.url, model, requests))
        burst = summarize(requests, outcomes, time.monotonic() - burst_began,
                          load_profile(plan.profile).mean_output_tokens)
        memory = [psutil.Process(pid).memory_full_info() for name, pid
                  in started_pids(server.run_dir).items() if name != "gateway"]
        return {"workers": plan.workers, "layout": f"{prefill}P+{plan.workers - prefill}D",
                "launch_to_all_registered_s": registered_s, **beats,
                "burst": asdict(burst), "routes_per_s": burst.streams / burst.wall_s,
                "route": route_times(server.url),
                "worker_rss_mb_mean": sum(m.rss for m in memory) / len(memory) / MB,
                "worker_uss_mb_mean": sum(m.uss for m in memory) / len(memory) / MB}


def _beats_per_s(url: str, seconds: float) -> dict[str, float]:
    def count() -> dict[str, float]:
        samples = metrics(url)
        return {kind: samples.get(f'raging_control_messages_total{{kind="{kind}"}}', 0)
                for kind in ("Heartbeat", "Alive")}
    before = count()
    time.sleep(seconds)
    after = count()
    return {f"{kind.lower()}s_per_s": (after[kind] - before[kind]) / seconds for kind in after}


def routing_scenario(plan: ScalePlan) -> dict[str, Any]:
    """The gateway's routing alone, in this process: a `Router` over 8 to 256 workers (a
    quarter prefill) with loads as heartbeats report them, 2,000 prompts of 100-300 tokens
    routed each, prefix caching off and on."""
    results = {}
    for workers in (8, 64, 256):
        for caching in (False, True):
            router = _loaded_router(workers, caching)
            requests = sim_requests(2000, 1, seed=6)
            times = []
            for request in requests:
                began = time.thread_time()
                route = router.route(request.prompt)
                times.append(time.thread_time() - began)
                assert route is not None
                route.decode.active[str(len(times))] = len(request.prompt)
            times.sort()
            results[f"{workers} workers, prefix caching {'on' if caching else 'off'}"] = {
                "mean_us": sum(times) / len(times) * 1e6,
                "p99_us": times[int(len(times) * 0.99)] * 1e6}
    return results


def _loaded_router(workers: int, caching: bool) -> Router:
    config = GatewayConfig()
    registry = make_registry(config, "sim")
    rng = random.Random(workers)
    for index in range(workers):
        role: Role = "prefill" if index < workers // 4 else "decode"
        worker_id = f"{role}-{index}"
        registry.register(Register(worker_id, "i", role, "tcp://127.0.0.1:1", "sim", 16, 16384,
                                   "host", [], 0, 256, "sim", caching, 1000))
        registry.heartbeat(Heartbeat(worker_id, "i", rng.randrange(5000),
                                     rng.randrange(1000, 16000), rng.randrange(200), 0))
    return make_router(config, registry)


RUNS: dict[str, Callable[[ScalePlan], dict[str, Any]]] = {
    "streams": streams_scenario, "relay": relay_scenario, "workers": workers_scenario,
    "routing": routing_scenario}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("scale", help="simulated workers: thousands of streams, the "
                                 "gateway's relay, many workers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", choices=(*SCENARIOS, "all"), default=["all"])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=6)
    parser.add_argument("--kv-bytes", type=float, default=0.25,
                        help="streams: the share of the profile's KV bytes (sim.kv_bytes)")
    parser.add_argument("--relay-streams", type=int, default=256)
    parser.add_argument("--relay-output-len", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--burst", type=int, default=0,
                        help="workers: requests sent at once (default: 8 per worker)")
    parser.add_argument("--burst-output-len", type=int, default=16)
    parser.add_argument("--profile", default="default", help="configs/sim/NAME.yaml")
    parser.add_argument("--out", type=Path, help="results JSON (default: runs/bench-*/)")
    parser.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if min(args.streams, args.output_len, args.prefill, args.decode, args.relay_streams,
           args.relay_output_len, args.burst_output_len) < 1 or args.burst < 0 \
            or args.workers < 2 or not 0 < args.kv_bytes <= 1:
        raise ValueError("counts >= 1, --burst >= 0, --workers >= 2, --kv-bytes in (0, 1]")
    load_profile(args.profile)  # a bad name fails now, not after a launch
    plan = ScalePlan(args.streams, args.output_len, args.prefill, args.decode, args.kv_bytes,
                     args.relay_streams, args.relay_output_len, args.workers, args.burst,
                     args.burst_output_len, args.profile)
    scenarios = SCENARIOS if "all" in args.scenarios else tuple(args.scenarios)
    out = args.out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}" / "scale.json"
    return lambda: run(plan, scenarios, out, list(argv))


def run(plan: ScalePlan, scenarios: Sequence[str], out: Path, argv: list[str]) -> int:
    results: dict[str, Any] = {"command": ["python", "-m", "bench", *argv], "plan": asdict(plan),
                               "cpu": cpu_summary(), "profile": load_profile(plan.profile).source}
    for name in scenarios:
        print(f"[scale] {name}", flush=True)
        results[name] = RUNS[name](plan)
        write_json(results, out)
        print(json.dumps(results[name], indent=1, default=str), flush=True)
    print(f"wrote {out}")
    return 0
