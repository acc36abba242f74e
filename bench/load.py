"""The request loops: closed loop (fixed concurrency) or open loop (Poisson arrivals).

Both are bounded: at most the given requests, none started after `duration_s`, each one cut off
after `request_timeout_s`; so a run always ends by itself.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import httpx
from tqdm import tqdm

from bench.client import RequestResult, stream_request
from bench.workloads import RequestSpec

Send = Callable[[RequestSpec], Awaitable[RequestResult]]


@dataclass(frozen=True)
class Load:
    """How requests are sent: `concurrency` streams (closed loop) or `rate` arrivals per second.

    With both, arrivals are Poisson at `rate` and at most `concurrency` are in flight.
    """

    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None:
            raise ValueError("give a concurrency or a rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.request_timeout_s <= 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise ValueError("timeouts and durations must be > 0")


@dataclass(frozen=True)
class LoadRun:
    """The measured requests of one run and its wall time (first send to last answer)."""

    results: tuple[RequestResult, ...]
    duration_s: float
    unsent: int  # requests not started because the duration bound was reached


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrival times (seconds from the start) of `count` requests; the first at 0."""
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]
    return list(accumulate(gaps))[:count]


async def closed_loop(send: Send, specs: Sequence[RequestSpec], concurrency: int,
                      deadline: float | None) -> list[RequestResult]:
    """`concurrency` streams, each sending its next request as soon as the last one ends."""
    pending = iter(specs)
    results: list[RequestResult] = []

    async def stream() -> None:
        for spec in pending:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            results.append(await send(spec))

    await asyncio.gather(*(stream() for _ in range(min(concurrency, len(specs)))))
    return results


async def open_loop(send: Send, specs: Sequence[RequestSpec], load: Load,
                    deadline: float | None) -> list[RequestResult]:
    """Requests sent at Poisson arrival times, at most `load.concurrency` in flight if set."""
    assert load.rate is not None
    limit = asyncio.Semaphore(load.concurrency or len(specs) or 1)

    async def limited(spec: RequestSpec) -> RequestResult:
        async with limit:
            return await send(spec)

    start = time.perf_counter()
    tasks = []
    for spec, offset in zip(specs, arrival_offsets(len(specs), load.rate,
                                                   random.Random(load.seed)), strict=True):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if deadline is not None and time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(limited(spec)))
    return list(await asyncio.gather(*tasks))


async def run_load(client: httpx.AsyncClient, model: str, specs: Sequence[RequestSpec],
                   load: Load, label: str) -> LoadRun:
    """Send `specs` under `load`, with a progress bar named `label`."""
    start = time.perf_counter()
    deadline = None if load.duration_s is None else start + load.duration_s
    bar = tqdm(total=len(specs), desc=label, unit="req", leave=False)

    async def send(spec: RequestSpec) -> RequestResult:
        result = await stream_request(client, model, spec, load.request_timeout_s, start)
        bar.update()
        return result

    try:
        if load.rate is None:
            assert load.concurrency is not None
            results = await closed_loop(send, specs, load.concurrency, deadline)
        else:
            results = await open_loop(send, specs, load, deadline)
    finally:
        bar.close()
    ordered = tuple(sorted(results, key=lambda r: r.index))
    return LoadRun(ordered, time.perf_counter() - start, len(specs) - len(results))


async def warm_up(client: httpx.AsyncClient, model: str, specs: Sequence[RequestSpec],
                  load: Load) -> None:
    """Send `specs` (not counted) with the run's concurrency, so the server is warm."""
    if specs:
        warm = Load(concurrency=load.concurrency or len(specs),
                    request_timeout_s=load.request_timeout_s)
        await run_load(client, model, specs, warm, "warm-up")
