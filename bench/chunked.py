"""`chunked`: time to first token of a short prompt sent while a long one is being prefilled,
with chunked prefill on and off.

Two launched servers, the same but for `prefill.chunk_tokens`: on (default 256) and off
(100,000, and as large a step budget, `prefill.max_batch_tokens`: a 4,000-token prompt runs in
one pass). On each: the short prompt alone, then, per repeat, a
fresh long prompt, a pause of `delay_s` (the long one is then mid-prefill) and a fresh short
one; both TTFTs are measured. Every prompt is new, so the prefix cache plays no part.
By default conditional disaggregation is off, so that the short prompt waits on the prefill
worker and chunking alone decides how long (with it on, the gateway would send the short
prompt to the idle decode worker).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bench.client import RequestResult, served_model, stream_request
from bench.launcher import PURE_DISAGG, launched, model_dir
from bench.prompts import TokenPrompts
from bench.workloads import RequestSpec

_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ChunkedPlan:
    launch_flags: tuple[str, ...]
    long_len: int
    short_len: int
    output_len: int
    delay_s: float
    repeats: int
    chunk_on: int
    chunk_off: int


@dataclass(frozen=True)
class Measured:
    """One server's TTFTs: the short prompt alone, and each contended (long, short) pair."""

    chunk_tokens: int
    alone: list[RequestResult]
    pairs: list[tuple[RequestResult, RequestResult]]


class _Specs:
    """Fresh prompts, numbered so that no two requests share a prefix."""

    def __init__(self, prompts: TokenPrompts, plan: ChunkedPlan) -> None:
        self.prompts = prompts
        self.plan = plan
        self.next = 0

    def make(self, kind: str, length: int) -> RequestSpec:
        self.next += 1
        return RequestSpec(self.next, kind, self.prompts.prompt(self.next, length), length,
                           self.plan.output_len)


def run(plan: ChunkedPlan) -> list[Measured]:
    """Launch a server per setting of chunk_tokens (on, then off) and measure it."""
    specs = _Specs(TokenPrompts(model_dir(plan.launch_flags)), plan)
    measured = []
    for chunk_tokens in (plan.chunk_on, plan.chunk_off):
        flags = (*plan.launch_flags, "--set", f"prefill.chunk_tokens={chunk_tokens}")
        if chunk_tokens == plan.chunk_off:
            flags += ("--set", f"prefill.max_batch_tokens={chunk_tokens}")
        with launched(flags) as server:
            measured.append(asyncio.run(_measure(server.url, plan, specs, chunk_tokens)))
    return measured


async def _measure(url: str, plan: ChunkedPlan, specs: _Specs, chunk_tokens: int) -> Measured:
    async with httpx.AsyncClient(base_url=url, timeout=_TIMEOUT_S) as client:
        model = await served_model(client)

        async def one(kind: str, length: int) -> RequestResult:
            return await stream_request(client, model, specs.make(kind, length), _TIMEOUT_S, 0.0)

        await one("warm-up", plan.short_len)
        alone, pairs = [], []
        steps = tqdm(range(2 * plan.repeats), desc=f"chunk_tokens={chunk_tokens}", unit="req")
        for i in steps:
            if i < plan.repeats:
                alone.append(await one("alone", plan.short_len))
                continue
            long_task = asyncio.create_task(one("long", plan.long_len))
            await asyncio.sleep(plan.delay_s)
            short = await one("short", plan.short_len)
            pairs.append((await long_task, short))
    return Measured(chunk_tokens, alone, pairs)


def markdown(plan: ChunkedPlan, measured: Sequence[Measured]) -> str:
    """Median TTFTs per server, and the ratios that matter."""
    failed = [r.error for m in measured for r in _all(m) if not r.ok]
    if failed:
        return f"failed requests: {failed}"
    rows = [
        f"| chunk_tokens | short alone ms | short behind {plan.long_len}-token prompt ms "
        f"| behind / alone | long prompt TTFT ms |",
        "|---|---|---|---|---|",
    ]
    for m in measured:
        alone = _median_ms(m.alone)
        behind = _median_ms([s for _, s in m.pairs])
        long = _median_ms([lg for lg, _ in m.pairs])
        rows.append(f"| {m.chunk_tokens} | {alone:.0f} | {behind:.0f} | {behind / alone:.1f}x "
                    f"| {long:.0f} |")
    on, off = (_median_ms([s for _, s in m.pairs]) for m in measured)
    rows.append(f"\nshort prompt's TTFT behind the long one, chunking off / on: {off / on:.1f}x "
                f"(medians of {plan.repeats}; {plan.short_len}-token prompt sent "
                f"{plan.delay_s:g} s after the long one)")
    return "\n".join(rows)


def _all(measured: Measured) -> list[RequestResult]:
    return [*measured.alone, *(r for pair in measured.pairs for r in pair)]


def _median_ms(results: Sequence[RequestResult]) -> float:
    return statistics.median(r.ttft_s or 0.0 for r in results) * 1000


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench chunked`: a short prompt's TTFT behind a long one, chunking on/off."""
    parser = commands.add_parser("chunked", help="TTFT behind a long prompt: chunked prefill",
                                 description=__doc__)
    pure = " ".join(("--prefill", "1", "--decode", "1", *PURE_DISAGG))
    parser.add_argument("--launch", default=pure,
                        help="launch.sh flags of the server (default: %(default)s)")
    parser.add_argument("--long-len", type=int, default=4000)
    parser.add_argument("--short-len", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--delay", type=float, default=1.0,
                        help="seconds between the long prompt and the short one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-on", type=int, default=256, help="prefill.chunk_tokens, on")
    parser.add_argument("--chunk-off", type=int, default=100_000,
                        help="prefill.chunk_tokens and max_batch_tokens, off (over the long "
                             "prompt's cost)")
    parser.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if min(args.long_len, args.short_len, args.output_len, args.repeats, args.chunk_on,
           args.chunk_off) < 1 or args.delay < 0:
        raise ValueError("lengths, --repeats and chunk sizes must be >= 1, --delay >= 0")
    plan = ChunkedPlan(tuple(shlex.split(args.launch)), args.long_len, args.short_len,
                       args.output_len, args.delay, args.repeats, args.chunk_on, args.chunk_off)

    def job() -> int:
        print(markdown(plan, run(plan)))
        return 0
    return job
