"""`runner`: the bare batched forward pass, ours against transformers, same weights and threads.

Ours is `engine.runner.ModelRunner` over its paged KV cache; the reference is transformers'
`AutoModelForCausalLM` with its DynamicCache. Both compute the KV cache and the last token's
logits only. Figures:
- prefill tokens/s of one prompt of each length (batch 1), median of `repeats` runs;
- decode step time at each batch size with `context` tokens already cached: the context is
  prefilled once (untimed) and copied to every sequence, then `steps` greedy steps are timed
  after one untimed step; the median is reported.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner, torch_dtype
from engine.weights.dtypes import DTYPE_NAMES

BLOCK_SIZE = 16


@dataclass(frozen=True)
class RunnerPlan:
    """Sizes and repeats of the microbenchmark."""

    prefill_lens: tuple[int, ...] = (128, 512, 2048)
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    context: int = 256
    repeats: int = 3
    steps: int = 8
    dtype: str = "float32"  # both sides run in it (a DTYPE_NAMES name)
    quant_rows: int = -1  # ours: products of this many rows over the GGUF blocks (-1: measured)

    def __post_init__(self) -> None:
        sizes = (*self.prefill_lens, *self.batch_sizes, self.context, self.repeats, self.steps)
        if not self.prefill_lens or not self.batch_sizes or min(sizes) < 1:
            raise ValueError("every length, batch size, repeat and step count must be >= 1")
        if self.quant_rows < -1:
            raise ValueError(f"quant_rows must be -1 (measured) or more, not {self.quant_rows}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, not {self.dtype!r}")


QUICK = RunnerPlan(repeats=1, steps=3)


@dataclass(frozen=True)
class Figures:
    """One implementation's figures: prefill tokens/s by length, decode step seconds by batch."""

    prefill_tokens_per_s: dict[int, float]
    decode_step_s: dict[int, float]
    next_token: int  # greedy next token after the shortest prefill prompt


@dataclass(frozen=True)
class RunnerResults:
    """Ours and transformers' figures on one model with one thread setting."""

    model: str
    threads: int
    plan: RunnerPlan
    ours: Figures
    transformers: Figures
    quant_rows: int  # ours: the most rows multiplied over the weights' blocks (0: none)
    isa: str = ""  # ours: the instruction set the kernels ran at ("torch": none built)

    @property
    def same_next_token(self) -> bool:
        """Whether both predict the same greedy token after the shortest prompt."""
        return self.ours.next_token == self.transformers.next_token

    def prefill_speedup(self) -> dict[int, float]:
        """Ours / transformers prefill tokens/s, by prompt length."""
        theirs = self.transformers.prefill_tokens_per_s
        return {n: rate / theirs[n] for n, rate in self.ours.prefill_tokens_per_s.items()}

    def decode_speedup(self) -> dict[int, float]:
        """Ours / transformers decode throughput (their step time / ours), by batch size."""
        theirs = self.transformers.decode_step_s
        return {b: theirs[b] / seconds for b, seconds in self.ours.decode_step_s.items()}


class Backend(Protocol):
    """One implementation of the forward pass under test."""

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits `[vocab]` of the last token after prefilling `ids` from scratch."""
        ...

    def decode_times(self, batch: int, context: Sequence[int], steps: int) -> list[float]:
        """Seconds of each of `steps` timed decode steps of `batch` copies of `context`."""
        ...


def timed(function: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


class OursBackend:
    """Our ModelRunner, with a cache big enough for the largest prefill or decode batch."""

    def __init__(self, folder: Path, plan: RunnerPlan) -> None:
        per_seq = blocks_needed(plan.context + plan.steps + 1, BLOCK_SIZE)
        num_blocks = max(blocks_needed(max(plan.prefill_lens), BLOCK_SIZE),
                         per_seq * max(plan.batch_sizes))
        self.runner = ModelRunner(folder, num_blocks, BLOCK_SIZE, torch_dtype(plan.dtype),
                                  None if plan.quant_rows < 0 else plan.quant_rows)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits of the last token of `ids`, prefilled into freshly allocated blocks."""
        table = self.runner.allocator.allocate(blocks_needed(len(ids), BLOCK_SIZE))
        try:
            return self.runner.forward(ForwardBatch([list(ids)], [0], [table]))[0]
        finally:
            self.runner.allocator.free(table)

    def decode_times(self, batch: int, context: Sequence[int], steps: int) -> list[float]:
        """Prefill `context` once, copy its KV to `batch` sequences, then time greedy steps."""
        runner, n = self.runner, len(context)
        tables = [runner.allocator.allocate(blocks_needed(n + steps + 1, BLOCK_SIZE))
                  for _ in range(batch)]
        try:
            logits = runner.forward(ForwardBatch([list(context)], [0], [tables[0]]))
            k, v = runner.cache.read(tables[0], n)
            for table in tables[1:]:
                runner.cache.write(table, 0, k, v)
            tokens = logits.argmax(-1).repeat(batch).tolist()
            times = []
            for step in range(steps + 1):
                forward = ForwardBatch([[t] for t in tokens], [n + step] * batch, tables)
                start = time.perf_counter()
                tokens = runner.forward(forward).argmax(-1).tolist()
                times.append(time.perf_counter() - start)
            return times[1:]
        finally:
            for table in tables:
                runner.allocator.free(table)


class TransformersBackend:
    """transformers' own model class for the folder, with its DynamicCache."""

    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits of the last token of `ids` (the cache is built, as a server would)."""
        out = self.model(torch.tensor([list(ids)]), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode_times(self, batch: int, context: Sequence[int], steps: int) -> list[float]:
        """Prefill `context` once, repeat its cache `batch` times, then time greedy steps."""
        out = self.model(torch.tensor([list(context)]), use_cache=True, logits_to_keep=1)
        cache = out.cache
        cache.batch_repeat_interleave(batch)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True).repeat(batch, 1)
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            out = self.model(tokens, cache=cache, use_cache=True)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
        return times[1:]


def measure(backend: Backend, prompt: Callable[[int], Sequence[int]], plan: RunnerPlan,
            progress: Callable[[str], None]) -> Figures:
    """Every figure of `plan` for one backend; `progress(what)` after each one."""
    shortest = prompt(min(plan.prefill_lens))
    next_token = int(backend.prefill(shortest).argmax())  # also warms the backend up
    prefill = {}
    for n in plan.prefill_lens:
        ids = prompt(n)
        seconds = statistics.median(timed(partial(backend.prefill, ids))
                                    for _ in range(plan.repeats))
        prefill[n] = n / seconds
        progress(f"prefill {n}")
    decode = {}
    for batch in plan.batch_sizes:
        decode[batch] = statistics.median(backend.decode_times(batch, prompt(plan.context),
                                                               plan.steps))
        progress(f"decode batch {batch}")
    return Figures(prefill, decode, next_token)


def run(folder: Path, plan: RunnerPlan, prompt: Callable[[int], Sequence[int]],
        progress: Callable[[str], None]) -> RunnerResults:
    """Ours, then transformers, on the model in `folder` with torch's current thread count."""
    backend = OursBackend(folder, plan)
    quant_rows, isa = backend.runner.model.quant_rows, backend.runner.kernel_isa
    ours = measure(backend, prompt, plan, progress)
    del backend
    gc.collect()
    theirs = measure(TransformersBackend(folder, torch_dtype(plan.dtype)), prompt, plan, progress)
    return RunnerResults(str(folder), torch.get_num_threads(), plan, ours, theirs, quant_rows,
                         isa)
