"""`python -m bench policies`: the gateway's routing and admission policies compared on one
trace (bench/trace.py), each on a fresh simulated cluster (`--model sim`, engine/sim).

For each policy of POLICIES (its `--set` flags on top of the shipped settings), launch.sh
starts the cluster; the trace is replayed open loop, each request sent at its arrival time as
token ids (`prompt_ids`: requests of one prefix group share their first `prefix_tokens` ids),
streamed, greedy, `ignore_eos`, `max_tokens` its output length. Every stream's text is checked
against the simulated model's answer (engine.sim.tokens.continuation): a wrong one is a bug,
counted and reported. Per policy, as bench/summary.py measures a run: goodput (requests within
the SLO per second of the run, first send to last answer), SLO attainment (a failed request
misses), p50/p99 TTFT and TPOT, failures by kind; and its wrong streams and the routes the
gateway took (raging_disagg_decision, pulls).
Output: DIR/results.json, DIR/results.md, DIR/policies.png.

Simulated workers report no CPUs, so the gateway's packing (gateway/packing.py) sees each
worker as a unit of its own: `prefill_routing` pack and spread route alike (PACK_NOTES).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.client import RequestResult, StreamError, read_stream, request_body
from bench.launcher import PURE_DISAGG, launched
from bench.load import LoadRun
from bench.plots import cdf
from bench.report import ms_cell, table, write_json
from bench.serve import open_client
from bench.sim_streams import expected_text
from bench.stats import Distribution, Slo
from bench.summary import Summary, summarize
from bench.trace import TraceRequest, describe, read_trace
from bench.workloads import RequestSpec
from engine.kernels.isa import cpu_summary
from engine.sim.profile import load_profile

LOW_ID, HIGH_ID = 32, 126  # printable ASCII: one byte, one token of the simulated vocabulary
COMPLETIONS = "/v1/completions"
DEFAULT_SLO = Slo(ttft_s=1.0, tpot_s=0.1)


@dataclass(frozen=True)
class Policy:
    """A named policy: gateway settings (`section.key`, value) over the shipped ones, what it
    is in one line, and (`same_as`) the policy it routes identically to under the sim."""

    name: str
    settings: tuple[tuple[str, str], ...]
    what: str
    same_as: str = ""

    def flags(self) -> tuple[str, ...]:
        """Its launch.sh flags."""
        return tuple(word for key, value in self.settings for word in ("--set", f"{key}={value}"))


def _pairs(flags: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(key, value) of `--set key=value` flags."""
    sets = [flags[i + 1] for i in range(0, len(flags), 2) if flags[i] == "--set"]
    return tuple((key, value) for key, _, value in (s.partition("=") for s in sets))


POLICIES: tuple[Policy, ...] = (
    Policy("shipped", (), "the shipped rule: prompts <= 32 tokens prefilled on the decode "
           "worker, <= 256 while every prefill worker holds >= 1024 tokens; pack; history "
           "follow; pulls auto"),
    Policy("pure-disagg", _pairs(PURE_DISAGG), "no local_short / local_saturated: a prefill "
           "worker prefills every prompt, unless a decode worker caches its prefix "
           "(local_cached)"),
    Policy("all-prefill", (*_pairs(PURE_DISAGG), ("decode.prefix_caching", "false"),
                           ("gateway.pull_prefixes", "never")),
           "pure-disagg with decode workers' prefix cache and pulls off: a prefill worker "
           "prefills every prompt (its own prefix cache still counts)"),
    Policy("local-256", (("gateway.local_prefill_max_tokens", "256"),),
           "a wider rule: every prompt <= 256 tokens prefilled on its decode worker"),
    Policy("decode-spread", (("gateway.decode_routing", "spread"),),
           "decode: the most free KV among all workers, batch full or not (pack: among those "
           "with room)"),
    Policy("prefill-spread", (("gateway.prefill_routing", "spread"),),
           "prefill: each worker by its own queue (pack groups workers by CPUs: none here)",
           same_as="shipped"),
    Policy("history-spread", (("gateway.history_routing", "spread"),),
           "no prefix affinity: a prompt avoids the decode workers holding its longest "
           "cached prefix while another has room"),
    Policy("no-pull", (("gateway.pull_prefixes", "never"),),
           "a decode worker never pulls a cached prefix from another worker"),
)
BY_NAME = {policy.name: policy for policy in POLICIES}
PACK_NOTES = (
    "Simulated workers report no CPUs (core/worker.py), so gateway/packing.py makes each "
    "worker a unit of its own: `prefill_routing` pack and spread then choose the same prefill "
    "worker (the least work), and `prefill-spread` routes as `shipped` does: its row measures "
    "the run-to-run noise. `decode_routing` pack still leaves out the decode workers without "
    "room (a full batch, decode.max_running, or KV past gateway.pack_kv_fraction) before "
    "taking the most free KV; spread takes the most free KV among all: the two differ only "
    "once a worker is full.")


def policy_named(name: str) -> Policy:
    """The policy `name` of POLICIES (ValueError naming the known ones)."""
    if name not in BY_NAME:
        raise ValueError(f"unknown policy {name!r}: one of {sorted(BY_NAME)}")
    return BY_NAME[name]


def _ids(key: str, length: int) -> tuple[int, ...]:
    """`length` printable token ids drawn from `key` (the same on every run and machine)."""
    rng = random.Random(key)
    return tuple(rng.randint(LOW_ID, HIGH_ID) for _ in range(length))


@lru_cache(maxsize=1024)
def _group_ids(group: str, length: int) -> tuple[int, ...]:
    return _ids(f"group {group}", length)


def prompt_ids(request: TraceRequest, index: int) -> tuple[int, ...]:
    """Request `index`'s prompt: its group's first `prefix_tokens` ids, then ids of its own,
    the first of which differs from the group's next, so the shared prefix is exactly that."""
    shared = request.prefix_tokens
    group = _group_ids(str(request.prefix_group), shared + 1) if shared else ()
    own = list(_ids(f"request {index}", request.prompt_tokens - shared))
    if own and group and own[0] == group[shared]:
        own[0] = LOW_ID + (own[0] - LOW_ID + 1) % (HIGH_ID - LOW_ID + 1)
    return group[:shared] + tuple(own)


@dataclass(frozen=True)
class Prepared:
    """A trace's requests as sent: prompts and the answers expected."""

    trace: tuple[TraceRequest, ...]
    prompts: tuple[tuple[int, ...], ...]
    expected: tuple[str, ...]


def prepare_trace(trace: Sequence[TraceRequest], mean_output_tokens: int) -> Prepared:
    """Prompts and expected answers of every request of `trace`."""
    prompts = tuple(prompt_ids(request, i) for i, request in enumerate(trace))
    expected = tuple(expected_text(p, r.output_tokens, mean_output_tokens)
                     for p, r in zip(prompts, trace, strict=True))
    return Prepared(tuple(trace), prompts, expected)


@dataclass(frozen=True)
class Replayed:
    """One replayed request: what it measured, how late it was sent after its arrival time,
    and whether its text was the expected one (a failed request is not `right`)."""

    request: TraceRequest
    result: RequestResult
    lag_s: float
    right: bool

    @property
    def wrong(self) -> bool:
        """A stream that completed with other text than the model's answer."""
        return self.result.ok and not self.right


async def send(client: httpx.AsyncClient, model: str, spec: RequestSpec, timeout_s: float,
               run_start: float) -> tuple[RequestResult, str]:
    """Stream one request (as bench.client.stream_request does) and keep its text too."""
    start = time.perf_counter()
    base = RequestResult(spec.index, spec.kind, start - run_start, spec.input_len,
                         spec.output_len)
    try:
        async with asyncio.timeout(timeout_s):
            arrivals, usage, text = await read_stream(client, COMPLETIONS,
                                                      request_body(model, spec), start)
    except TimeoutError:
        return _failed(base, f"timeout after {timeout_s:g}s"), ""
    except httpx.HTTPError as error:
        return _failed(base, f"{type(error).__name__}: {error}"), ""
    except StreamError as error:
        return _failed(base, str(error)), ""
    if not arrivals:
        return _failed(base, "stream ended without any token"), ""
    usage = usage or {}
    done = RequestResult(
        spec.index, spec.kind, base.start_s, spec.input_len, spec.output_len,
        ttft_s=arrivals[0], e2e_s=time.perf_counter() - start, chunk_times_s=tuple(arrivals),
        prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=int(usage.get("completion_tokens", len(arrivals))),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    return done, text


def _failed(base: RequestResult, error: str) -> RequestResult:
    return RequestResult(base.index, base.kind, base.start_s, base.input_len, base.max_tokens,
                         error=error)


async def replay(client: httpx.AsyncClient, model: str, prepared: Prepared,
                 timeout_s: float, label: str) -> tuple[tuple[Replayed, ...], float]:
    """Send every request of the trace at its arrival time (open loop); the requests as
    replayed, and the run's wall time (first send to last answer)."""
    bar = tqdm(total=len(prepared.trace), desc=label, unit="req", leave=False)
    start = time.perf_counter()
    first = prepared.trace[0].arrival_s

    async def one(index: int, request: TraceRequest) -> Replayed:
        spec = RequestSpec(index, "trace", prepared.prompts[index], request.prompt_tokens,
                           request.output_tokens)
        result, text = await send(client, model, spec, timeout_s, start)
        bar.update()
        return Replayed(request, result, result.start_s - (request.arrival_s - first),
                        result.ok and text == prepared.expected[index])

    tasks = []
    try:
        for index, request in enumerate(prepared.trace):
            await asyncio.sleep(max(0.0, start + request.arrival_s - first - time.perf_counter()))
            tasks.append(asyncio.create_task(one(index, request)))
        replayed = tuple(await asyncio.gather(*tasks))
    finally:
        bar.close()
    return replayed, time.perf_counter() - start


def route_counts(metrics_text: str) -> dict[str, float]:
    """The gateway's routes by path (raging_disagg_decision) and prefix pulls it routed (by the
    holder's pool), from its /metrics page."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "raging_disagg_decision_total":
                counts[sample.labels["path"]] = sample.value
            elif sample.name == "raging_kv_pulls_routed_total":
                counts[f"pull_from_{sample.labels['holder_role']}"] = sample.value
    return counts


@dataclass(frozen=True)
class PolicyRun:
    """One policy's replay: its launch flags, its requests, wall time and the routes taken."""

    policy: Policy
    flags: tuple[str, ...]
    replayed: tuple[Replayed, ...]
    duration_s: float
    routes: dict[str, float]


@dataclass(frozen=True)
class PolicySummary:
    """A policy's figures: bench.summary's over its replay (goodput and attainment against the
    SLO, latencies, failures by kind), and its wrong streams, the p99 of how late requests were
    sent, the share of prompt tokens its workers had cached, and the routes the gateway took."""

    policy: str
    summary: Summary
    wrong: int
    send_lag_p99_s: float
    cached_prompt_share: float
    routes: dict[str, float]


def summarize_run(run: PolicyRun, slo: Slo) -> PolicySummary:
    """`run` judged against `slo`."""
    results = tuple(r.result for r in run.replayed)
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    return PolicySummary(
        run.policy.name, summarize(LoadRun(results, run.duration_s, 0), slo),
        sum(r.wrong for r in run.replayed),
        Distribution.of([r.lag_s for r in run.replayed]).p99,
        sum(r.cached_tokens or 0 for r in done) / prompt if prompt else 0.0, run.routes)


@dataclass(frozen=True)
class ReplayPlan:
    """What `python -m bench policies` runs: the trace, the policies, the cluster and the SLO.

    `extra` are launch.sh flags every policy's cluster gets (after the policy's own)."""

    trace_path: str
    prepared: Prepared
    policies: tuple[Policy, ...]
    prefill: int = 2
    decode: int = 6
    profile: str = "default"
    time_scale: float = 1.0
    kv_bytes: float = 1.0
    slo: Slo = DEFAULT_SLO
    extra: tuple[str, ...] = ()
    request_timeout_s: float = 120.0

    def flags(self, policy: Policy) -> tuple[str, ...]:
        """launch.sh flags of `policy`'s cluster."""
        model = "sim" if self.profile == "default" else f"sim:{self.profile}"
        scaled = ("--set", f"sim.time_scale={self.time_scale:g}")
        shrunk = ("--set", f"sim.kv_bytes={self.kv_bytes:g}") if self.kv_bytes != 1 else ()
        return ("--model", model, "--prefill", str(self.prefill), "--decode", str(self.decode),
                *scaled, *shrunk, *policy.flags(), *self.extra)


def run_policy(plan: ReplayPlan, policy: Policy) -> PolicyRun:
    """Launch `policy`'s cluster, replay the trace on it, read its routes, stop it."""
    flags = plan.flags(policy)
    with launched(flags) as server:
        replayed, duration = asyncio.run(_replay_on(server.url, plan, policy.name))
        routes = route_counts(httpx.get(server.url + "/metrics", timeout=30).text)
    return PolicyRun(policy, flags, replayed, duration, routes)


async def _replay_on(url: str, plan: ReplayPlan, label: str
                     ) -> tuple[tuple[Replayed, ...], float]:
    async with open_client(url, None, plan.request_timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return await replay(client, str(model), plan.prepared, plan.request_timeout_s, label)


def run(plan: ReplayPlan) -> list[PolicyRun]:
    """Every policy of `plan` in turn, one cluster at a time."""
    runs = []
    for policy in tqdm(plan.policies, desc="policies", unit="policy"):
        runs.append(run_policy(plan, policy))
    return runs


def _routes_cell(routes: dict[str, float]) -> str:
    paths = ("disaggregated", "local_short", "local_saturated", "local_cached")
    pulls = sum(v for k, v in routes.items() if k.startswith("pull_from_"))
    return " / ".join(f"{routes.get(p, 0):.0f}" for p in paths) + f" / {pulls:.0f}"


def summary_row(row: PolicySummary) -> list[str]:
    """The Markdown row of one policy."""
    figures = row.summary
    return [f"`{row.policy}`", f"{figures.goodput_requests_per_s:.2f}",
            f"{figures.slo_attainment:.1%}",
            f"{ms_cell(figures.ttft_s.p50)} / {ms_cell(figures.ttft_s.p99)}",
            f"{ms_cell(figures.tpot_s.p50)} / {ms_cell(figures.tpot_s.p99)}",
            f"{figures.requests_per_s:.2f}", f"{row.cached_prompt_share:.0%}",
            _routes_cell(row.routes), str(figures.failed), str(row.wrong)]


SUMMARY_HEADER = ["policy", "goodput (req/s)", "SLO attainment", "TTFT p50 / p99 (ms)",
                  "TPOT p50 / p99 (ms)", "completed (req/s)", "prompt tokens cached",
                  "routes: disagg / short / saturated / cached / pulls", "errors",
                  "wrong streams"]


def markdown(plan: ReplayPlan, summaries: Sequence[PolicySummary]) -> str:
    """The results as Markdown: the setting, the per-policy table, the policies, the notes."""
    shape = describe(plan.prepared.trace)
    lines = [
        f"Trace `{plan.trace_path}`: {shape['requests']} requests over {shape['span_s']:.1f} s "
        f"({shape['rate'] or 0:.2f} req/s), mean prompt {shape['mean_prompt_tokens']:.0f} and "
        f"output {shape['mean_output_tokens']:.0f} tokens, {shape['grouped']} in "
        f"{shape['groups']} prefix groups.",
        f"Cluster: `{' '.join(plan.flags(Policy('-', (), '')))}` plus each policy's flags; "
        f"SLO: TTFT <= {plan.slo.ttft_s * 1000:.0f} ms and TPOT <= "
        f"{plan.slo.tpot_s * 1000:.0f} ms. Machine: {cpu_summary()}.", "",
        table(SUMMARY_HEADER, [summary_row(s) for s in summaries]), "",
        table(["policy", "flags", "what"],
              [[f"`{p.name}`", f"`{' '.join(p.flags())}`" if p.settings else "(none)",
                p.what + (f" (under the sim: routes as `{p.same_as}`)" if p.same_as else "")]
               for p in plan.policies]), "", PACK_NOTES]
    lines += ["", "Client send lag, p99 (how late requests left against the trace): "
              + ", ".join(f"`{s.policy}` {s.send_lag_p99_s * 1000:.0f} ms" for s in summaries)
              + "."]
    lines += [f"\nFailed requests of `{s.policy}`: {s.summary.errors}"
              for s in summaries if s.summary.errors]
    return "\n".join(lines) + "\n"


def request_record(replayed: Replayed) -> dict[str, Any]:
    """One request of a run as the JSON report keeps it (no per-token times)."""
    result = replayed.result
    return {"index": result.index, "arrival_s": replayed.request.arrival_s,
            "lag_s": replayed.lag_s, "prompt_tokens": replayed.request.prompt_tokens,
            "prefix_group": replayed.request.prefix_group, "max_tokens": result.max_tokens,
            "ok": result.ok, "error": result.error, "right": replayed.right,
            "ttft_s": result.ttft_s, "tpot_s": result.tpot_s, "e2e_s": result.e2e_s,
            "output_tokens": result.output_tokens, "cached_tokens": result.cached_tokens}


def as_json(plan: ReplayPlan, runs: Sequence[PolicyRun],
            summaries: Sequence[PolicySummary]) -> dict[str, Any]:
    """The whole report: the setting, then per policy its flags, summary and requests."""
    return {"benchmark": "policies", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": sys.argv, "machine": cpu_summary(), "trace": plan.trace_path,
            "trace_shape": describe(plan.prepared.trace), "slo": plan.slo,
            "cluster": {"prefill": plan.prefill, "decode": plan.decode,
                        "profile": plan.profile, "time_scale": plan.time_scale,
                        "kv_bytes": plan.kv_bytes, "extra": plan.extra},
            "notes": PACK_NOTES,
            "policies": [{"name": run.policy.name, "what": run.policy.what,
                          "same_as": run.policy.same_as, "flags": run.flags,
                          "duration_s": run.duration_s, "summary": summary,
                          "requests": [request_record(r) for r in run.replayed]}
                         for run, summary in zip(runs, summaries, strict=True)]}


def plot(summaries: Sequence[PolicySummary], runs: Sequence[PolicyRun], slo: Slo,
         path: Path) -> None:
    """Goodput per policy, and TTFT and TPOT CDFs per policy, with the SLO."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.5), layout="constrained")
    bars, ttft, tpot = figure.subplots(1, 3)
    names = [s.policy for s in summaries]
    bars.bar(names, [s.summary.goodput_requests_per_s for s in summaries])
    bars.set(title="goodput", ylabel="requests/s within the SLO")
    bars.tick_params(axis="x", labelrotation=45)
    for run in runs:
        done = [r.result for r in run.replayed if r.result.ok]
        cdf(ttft, [r.ttft_s for r in done if r.ttft_s is not None], run.policy.name)
        cdf(tpot, [t for r in done if (t := r.tpot_s) is not None], run.policy.name)
    for axes, name, limit in ((ttft, "TTFT", slo.ttft_s), (tpot, "TPOT", slo.tpot_s)):
        axes.axvline(limit * 1000, color="grey", linestyle=":", label="SLO")
        axes.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="share of requests",
                 xscale="log", ylim=(0, 1.02))
        axes.legend(fontsize="x-small")
    figure.savefig(path, dpi=110)


def write_results(plan: ReplayPlan, runs: Sequence[PolicyRun], out: Path) -> str:
    """results.json, results.md and policies.png in `out`; the Markdown."""
    summaries = [summarize_run(run, plan.slo) for run in runs]
    write_json(as_json(plan, runs, summaries), out / "results.json")
    text = markdown(plan, summaries)
    (out / "results.md").write_text(text)
    plot(summaries, runs, plan.slo, out / "policies.png")
    return text


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench policies --trace FILE --out DIR ...`."""
    parser = commands.add_parser("policies", help="routing policies replayed on a trace (sim)",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, help="a JSONL trace")
    parser.add_argument("--policy", action="append", choices=sorted(BY_NAME),
                        help="a policy to run (repeatable; default: all, in table order)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=6)
    parser.add_argument("--profile", default="default", help="sim profile (configs/sim)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="sim.time_scale")
    parser.add_argument("--kv-bytes", type=float, default=1.0, help="sim.kv_bytes")
    parser.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO.ttft_s, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=DEFAULT_SLO.tpot_s, help="seconds")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a setting every policy's cluster gets (repeatable)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if min(args.prefill, args.decode) < 0 or args.decode < 1 or args.time_scale < 0:
        raise ValueError("--decode >= 1, --prefill >= 0, --time-scale >= 0")
    if min(args.slo_ttft, args.slo_tpot, args.request_timeout) <= 0:
        raise ValueError("SLOs and --request-timeout must be > 0")
    policies = tuple(policy_named(n) for n in args.policy) if args.policy else POLICIES
    trace = read_trace(args.trace)
    mean = load_profile(args.profile).mean_output_tokens
    plan = ReplayPlan(str(args.trace), prepare_trace(trace, mean), policies, args.prefill,
                      args.decode, args.profile, args.time_scale, args.kv_bytes,
                      Slo(args.slo_ttft, args.slo_tpot),
                      tuple(w for s in args.set for w in ("--set", s)), args.request_timeout)

    def job() -> int:
        text = write_results(plan, run(plan), args.out)
        print(text)
        print(f"wrote {args.out}/results.json, results.md, policies.png", file=sys.stderr)
        return 0
    return job
