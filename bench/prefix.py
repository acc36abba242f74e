"""`prefix`: time to first token with a long prompt prefix cached, against the same cold.

One launched server. Each pair gets a fresh prefix of `prefix_len` tokens (so the first
request of a pair finds nothing cached) and two different suffixes: the cold request sends
prefix + suffix A, the warm one prefix + suffix B. Ratios are per pair, then the median.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bench.client import RequestResult, served_model, stream_request
from bench.launcher import launched, model_dir
from bench.prompts import TokenPrompts
from bench.workloads import RequestSpec


@dataclass(frozen=True)
class PrefixPlan:
    launch_flags: tuple[str, ...]
    prefix_len: int
    suffix_len: int
    output_len: int
    pairs: int


@dataclass(frozen=True)
class Pair:
    cold: RequestResult
    warm: RequestResult


def specs(plan: PrefixPlan, prompts: TokenPrompts) -> list[tuple[RequestSpec, RequestSpec]]:
    """Per pair: the cold and the warm request, sharing a prefix no other pair has."""
    pairs = []
    for i in range(plan.pairs + 1):  # pair 0 warms the server up
        prefix = prompts.prompt(3 * i, plan.prefix_len)
        suffixes = prompts.prompt(3 * i + 1, plan.suffix_len), prompts.prompt(3 * i + 2,
                                                                                plan.suffix_len)
        made = [RequestSpec(2 * i + j, kind, (*prefix, *suffix), plan.prefix_len
                            + plan.suffix_len, plan.output_len)
                for j, (kind, suffix) in enumerate(zip(("cold", "warm"), suffixes,
                                                       strict=True))]
        pairs.append((made[0], made[1]))
    return pairs


def run(plan: PrefixPlan) -> list[Pair]:
    """Launch the server, send each pair (cold, then warm), stop it."""
    prompts = TokenPrompts(model_dir(plan.launch_flags))
    with launched(plan.launch_flags) as server:
        return asyncio.run(_pairs(server.url, specs(plan, prompts)))


async def _pairs(url: str, pairs: Sequence[tuple[RequestSpec, RequestSpec]]) -> list[Pair]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = await served_model(client)
        measured = []
        for cold, warm in tqdm(pairs, desc="prefix pairs", unit="pair"):
            first = await stream_request(client, model, cold, 300, 0.0)
            second = await stream_request(client, model, warm, 300, 0.0)
            measured.append(Pair(first, second))
    return measured[1:]


def _ttft(result: RequestResult) -> float:
    assert result.ttft_s is not None, "a request that succeeded had a first token"
    return result.ttft_s


def markdown(plan: PrefixPlan, pairs: Sequence[Pair]) -> str:
    """Median TTFT cold and warm, the median of per-pair ratios, and cached tokens reported."""
    failed = [r.error for p in pairs for r in (p.cold, p.warm) if not r.ok]
    if failed:
        return f"failed requests: {failed}"
    cold = [_ttft(p.cold) for p in pairs]
    warm = [_ttft(p.warm) for p in pairs]
    ratios = [c / w for c, w in zip(cold, warm, strict=True)]
    return "\n".join([
        f"| prompt | TTFT ms (median of {len(pairs)}) | cached_tokens reported |",
        "|---|---|---|",
        f"| {plan.prefix_len} + {plan.suffix_len} tokens, cold | "
        f"{statistics.median(cold) * 1000:.0f} | {_values(p.cold for p in pairs)} |",
        f"| {plan.prefix_len} + {plan.suffix_len} tokens, prefix cached | "
        f"{statistics.median(warm) * 1000:.0f} | {_values(p.warm for p in pairs)} |",
        f"| cold / cached (median of per-pair ratios) | {statistics.median(ratios):.1f}x | |",
    ])


def _values(results: Iterable[RequestResult]) -> str:
    """The distinct cached_tokens values reported ("None": not reported)."""
    return ", ".join(sorted({str(r.cached_tokens) for r in results}))
