"""What disaggregation adds to the time to first token: one process against prefill + decode.

    python -m bench handoff [--input-len 512] [--repeats 5] [--backends shm,zmq]

In one process, our ModelRunner (one pinned core, one thread, as each worker runs) prefills the
prompt and samples the first token (TTFT), then runs one decode step (the second token).
Disaggregated, `scripts/launch.sh --prefill 1 --decode 1 --kv-backend B` serves the same
prompts (token ids, greedy), streamed over HTTP: TTFT and the second token as the client sees
them, so the figure holds the whole path: HTTP, gateway, control plane and the KV hand-off that
the decode worker needs before it can produce the second token.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from bench.client import served_model, stream_request
from bench.launcher import launched
from bench.prompts import TokenPrompts
from bench.workloads import RequestSpec
from engine.batch import ForwardBatch
from engine.block_allocator import blocks_needed
from engine.runner import ModelRunner

BLOCK_SIZE = 16


@dataclass(frozen=True)
class HandoffFigure:
    """Medians over the repeats, in seconds, of one backend against one process, measured
    alternately (one request each way, in turn) so that both see the same machine."""

    backend: str
    local_ttft_s: float
    local_second_s: float
    ttft_s: float
    second_s: float

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_s / self.local_ttft_s

    @property
    def second_ratio(self) -> float:
        return self.second_s / self.local_second_s


class OneProcess:
    """Prefill, sample, one decode step: in this process, pinned to `cpu`, one thread."""

    def __init__(self, folder: Path, max_len: int, cpu: int) -> None:
        self.cpu = cpu
        self.runner = ModelRunner(folder, blocks_needed(max_len + 2, BLOCK_SIZE), BLOCK_SIZE)

    def first_two_tokens(self, ids: list[int]) -> tuple[float, float]:
        mask, threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, {self.cpu})
        torch.set_num_threads(1)
        try:
            return _first_two_tokens(self.runner, ids)
        finally:
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, mask)


def _first_two_tokens(runner: ModelRunner, ids: list[int]) -> tuple[float, float]:
    table = runner.allocator.allocate(blocks_needed(len(ids) + 1, BLOCK_SIZE))
    try:
        start = time.perf_counter()
        first = int(runner.forward(ForwardBatch([ids], [0], [table]))[0].argmax())
        ttft = time.perf_counter() - start
        runner.forward(ForwardBatch([[first]], [len(ids)], [table]))[0].argmax()
        return ttft, time.perf_counter() - start
    finally:
        runner.allocator.free(table)


def compare(backend: str, local: OneProcess, prompts: list[tuple[int, ...]]) -> HandoffFigure:
    """`launch.sh --prefill 1 --decode 1 --kv-backend backend` against one process, in turn."""
    flags = ["--prefill", "1", "--decode", "1", "--kv-backend", backend]
    with launched(flags) as server:
        pairs = asyncio.run(_alternate(server.url, local, prompts))
    local_times, served_times = zip(*pairs, strict=True)
    return HandoffFigure(backend, *_medians(local_times), *_medians(served_times))


def _medians(times: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


async def _alternate(url: str, local: OneProcess, prompts: list[tuple[int, ...]],
                     ) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """(one process, served) first-two-token times of each prompt; the first pair warms up."""
    pairs = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = await served_model(client)
        for index, prompt in enumerate([prompts[0], *prompts]):
            spec = RequestSpec(index, "fixed", prompt, len(prompt), 2)
            result = await stream_request(client, model, spec, 120, time.perf_counter())
            if not result.ok or len(result.chunk_times_s) < 2:
                raise RuntimeError(f"request {index} failed: {result.error or 'one token'}")
            served = (result.chunk_times_s[0], result.chunk_times_s[1])
            pairs.append((local.first_two_tokens(list(prompt)), served))
    return pairs[1:]


def measure(folder: Path, input_len: int, repeats: int, backends: Sequence[str],
            progress: Callable[[str], None]) -> list[HandoffFigure]:
    maker = TokenPrompts(folder)
    prompts = [maker.prompt(index, input_len) for index in range(repeats)]
    # The core launch.sh gives the prefill worker: the first of this process's CPUs.
    local = OneProcess(folder, input_len, min(os.sched_getaffinity(0)))
    figures = []
    for backend in backends:
        figures.append(compare(backend, local, prompts))
        progress(backend)
    return figures


def markdown(figures: list[HandoffFigure], input_len: int) -> str:
    rows = [f"| KV backend | {input_len}-token prompt | TTFT ms | second token ms |",
            "|---|---|---|---|"]
    for f in figures:
        rows += [
            f"| {f.backend} | one process | {f.local_ttft_s * 1e3:.0f} | "
            f"{f.local_second_s * 1e3:.0f} |",
            f"| {f.backend} | disaggregated | {f.ttft_s * 1e3:.0f} | {f.second_s * 1e3:.0f} |",
            f"| {f.backend} | ratio | {f.ttft_ratio:.3f}x | {f.second_ratio:.3f}x |",
        ]
    return "\n".join(rows)


def run(folder: Path, input_len: int, repeats: int, backends: Sequence[str]) -> int:
    with tqdm(total=len(backends), desc="handoff") as bar:
        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()
        figures = measure(folder, input_len, repeats, backends, progress)
    print(markdown(figures, input_len))
    return 0
