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
from bench.launcher import ROOT, launched
from bench.prompts import TokenPrompts
from bench.workloads import RequestSpec
from core.config import PoolConfig, load_config
from core.cpus import running_on
from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner

CONFIG = ROOT / "configs/default.yaml"  # what launch.sh runs
_WARM_UP = 3  # requests: a fresh worker's first ones touch memory for the first time


@dataclass(frozen=True)
class HandoffFigure:
    """One backend against one process, measured alternately (one request each way, in turn)
    so that both see the same machine. Times are medians over the repeats; ratios are medians
    of each pair's ratio, which cancels the machine's drift between pairs."""

    backend: str
    local_ttft_s: float
    local_second_s: float
    ttft_s: float
    second_s: float
    ttft_ratio: float
    second_ratio: float


class OneProcess:
    """Prefill, sample, one decode step: in this process, pinned to `cpu`, one thread."""

    def __init__(self, folder: Path, config: PoolConfig, cpu: int) -> None:
        self.cpu = cpu  # the KV pool as a prefill worker's, so both touch memory alike
        self.runner = ModelRunner(folder, config.num_kv_blocks, config.block_size)

    def first_two_tokens(self, ids: list[int]) -> tuple[float, float]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with running_on(str(self.cpu)):
                return _first_two_tokens(self.runner, ids)
        finally:
            torch.set_num_threads(threads)


def _first_two_tokens(runner: ModelRunner, ids: list[int]) -> tuple[float, float]:
    table = runner.allocator.allocate(blocks_needed(len(ids) + 1, runner.block_size))
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
    ratios = [(s[0] / loc[0], s[1] / loc[1]) for loc, s in pairs]
    return HandoffFigure(backend, *_medians(local_times), *_medians(served_times),
                         *_medians(ratios))


def _medians(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


async def _alternate(url: str, local: OneProcess, prompts: list[tuple[int, ...]],
                     ) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """(one process, served) first-two-token times of each prompt, after _WARM_UP pairs."""
    pairs = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = await served_model(client)
        for index, prompt in enumerate([*prompts[:_WARM_UP], *prompts]):
            spec = RequestSpec(index, "fixed", prompt, len(prompt), 2)
            if index % 2:  # each goes first half of the time: neither always follows the other
                local_times = local.first_two_tokens(list(prompt))
            result = await stream_request(client, model, spec, 120, time.perf_counter())
            if not result.ok or len(result.chunk_times_s) < 2:
                raise RuntimeError(f"request {index} failed: {result.error or 'one token'}")
            if not index % 2:
                local_times = local.first_two_tokens(list(prompt))
            pairs.append((local_times, (result.chunk_times_s[0], result.chunk_times_s[1])))
    return pairs[_WARM_UP:]


def measure(folder: Path, input_len: int, repeats: int, backends: Sequence[str],
            progress: Callable[[str], None]) -> list[HandoffFigure]:
    maker = TokenPrompts(folder)
    prompts = [maker.prompt(index, input_len) for index in range(repeats)]
    # The core launch.sh gives the prefill worker: the first of this process's CPUs.
    local = OneProcess(folder, load_config(CONFIG).prefill, min(os.sched_getaffinity(0)))
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
