"""Many streams against a simulated model (`--model sim`), each checked token by token.

A simulated model's answer is known in advance (engine.sim.tokens.continuation), so every
stream of a run is compared with it: a dropped, cut, repeated or mixed-up stream shows as a
wrong one. Prompts are token ids (bytes 32-126), distinct per request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.client import StreamError, read_stream
from bench.serve import open_client
from bench.stats import percentile
from engine.sim.tokens import continuation, text_of

PHASES = ("before sending", "queued or prefilling", "after the first token", "decoding")


def expected_text(prompt: Sequence[int], max_tokens: int, mean_output_tokens: int) -> str:
    """The text of the simulated model's answer to `prompt`, generated past its ends, as
    requests asking `ignore_eos` get it."""
    return text_of(continuation(prompt, max_tokens, mean_output_tokens, ignore_eos=True))


@dataclass(frozen=True)
class SimRequest:
    prompt: tuple[int, ...]
    max_tokens: int

    def body(self, model: str, usage: bool = False) -> dict[str, object]:
        """A streamed, greedy completion that ignores the end token (with its usage last)."""
        return {"model": model, "prompt": list(self.prompt), "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": usage}}

    def expected(self, mean_output_tokens: int) -> str:
        """The text a simulated model streams back (EOS ignored)."""
        return expected_text(self.prompt, self.max_tokens, mean_output_tokens)


@dataclass(frozen=True)
class StreamOutcome:
    text: str
    ttft_s: float | None
    e2e_s: float
    error: str = ""


@dataclass(frozen=True)
class StreamsSummary:
    """How a run of streams went: counts, and latencies of the right ones."""

    streams: int
    right: int
    wrong: int
    failed: int
    errors: dict[str, int]
    wall_s: float
    output_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def sim_requests(count: int, output_len: int, seed: int = 0,
                 prompt_lens: tuple[int, int] = (100, 300)) -> list[SimRequest]:
    """`count` distinct prompts of lengths in `prompt_lens`, each asking `output_len` tokens."""
    rng = random.Random(seed)
    return [SimRequest(tuple(rng.randrange(32, 127) for _ in range(rng.randint(*prompt_lens))),
                       output_len) for _ in range(count)]


async def stream_one(client: httpx.AsyncClient, model: str, request: SimRequest,
                     timeout_s: float) -> StreamOutcome:
    began = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            arrivals, _, text = await read_stream(client, "/v1/completions",
                                                  request.body(model), began)
    except (TimeoutError, httpx.HTTPError, StreamError) as error:
        return StreamOutcome("", None, time.perf_counter() - began,
                             f"{type(error).__name__}: {error}"[:120])
    return StreamOutcome(text, arrivals[0] if arrivals else None, time.perf_counter() - began)


async def run_streams(url: str, model: str, requests: list[SimRequest],
                      timeout_s: float = 600) -> list[StreamOutcome]:
    """Every request streamed at once."""
    async with open_client(url, None, timeout_s) as client:
        return list(await asyncio.gather(*(stream_one(client, model, r, timeout_s)
                                           for r in requests)))


def summarize(requests: list[SimRequest], outcomes: list[StreamOutcome], wall_s: float,
              mean_output_tokens: int) -> StreamsSummary:
    right = [(r, o) for r, o in zip(requests, outcomes, strict=True)
             if not o.error and o.text == r.expected(mean_output_tokens)]
    failed = [o for o in outcomes if o.error]
    ttfts = [o.ttft_s for _, o in right if o.ttft_s is not None]
    return StreamsSummary(
        len(requests), len(right), len(requests) - len(right) - len(failed), len(failed),
        dict(Counter(o.error.split(":")[0] for o in failed)), wall_s,
        sum(r.max_tokens for r, _ in right), percentile(ttfts, 50), percentile(ttfts, 99))


async def abort_storm(url: str, model: str, requests: list[SimRequest],
                      concurrency: int) -> Counter[str]:
    """Each request dropped by its client in one of `PHASES`, in turn; what the clients saw."""
    rng = random.Random(7)
    gate = asyncio.Semaphore(concurrency)
    seen: Counter[str] = Counter()
    async with open_client(url, None, 60) as client:
        async def one(index: int, request: SimRequest) -> None:
            async with gate:
                seen[await abandon(client, request.body(model), rng,
                                   PHASES[index % len(PHASES)])] += 1
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return seen


async def abandon(client: httpx.AsyncClient, body: dict[str, object], rng: random.Random,
                  phase: str, timeout_s: float = 60) -> str:
    """One streamed completion, dropped by the client in `phase` (one of `PHASES`); what the
    client saw: "closed", "finished first" (it ended before the client left) or "timeout"."""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if phase == "before sending":
                    return "closed"
                if phase == "queued or prefilling":
                    await asyncio.sleep(rng.uniform(0, 0.02))
                    return "closed"
                wanted = 1 if phase == "after the first token" else rng.randint(2, 30)
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen >= wanted:
                        return "closed"
                return "finished first"
    except TimeoutError:
        return "timeout"
