"""Decode steps replayed as CUDA graphs.

A decode step of a few sequences on a GPU is bound by launching its ~15 kernels per layer one
by one; a captured graph launches them all at once. A graph has fixed shapes, so a step's batch
is padded to the next of `BATCH_SIZES` (padding rows write and read the cache's pad block) and
its block tables to the next power of two of blocks; each such pair is captured the first time
it occurs and kept. The graphs share one memory pool, which is safe because they replay one at
a time on one stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.kv.allocator import blocks_needed
from engine.kv.cache import PagedKVCache
from engine.model.attention import AttentionPlan, plan_attention
from engine.model.batch import ForwardBatch
from engine.model.llama import LlamaModel

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_WARMUPS = 2  # runs before capture, on a side stream, as torch.cuda.graph asks


def padded_size(num_seqs: int) -> int | None:
    """The batch size a graph is captured for that holds `num_seqs` rows; None beyond all."""
    return next((size for size in BATCH_SIZES if size >= num_seqs), None)


def padded_blocks(num_blocks: int) -> int:
    """The block-table width a graph is captured for that holds `num_blocks` blocks."""
    return 1 << max(0, num_blocks - 1).bit_length()


def padded_batch(batch: ForwardBatch, size: int, width: int, pad_block: int) -> ForwardBatch:
    """`batch` with rows added up to `size` (a token at position 0 in `pad_block`) and every
    block table filled to `width` blocks with `pad_block`."""
    extra = size - batch.num_seqs
    tables = [table + [pad_block] * (width - len(table))
              for table in [*batch.block_tables, *[[pad_block]] * extra]]
    return ForwardBatch(token_ids=[*batch.token_ids, *[[0]] * extra],
                        start_positions=[*batch.start_positions, *[0] * extra],
                        block_tables=tables)


def plan_tensors(plan: AttentionPlan) -> Iterator[torch.Tensor]:
    """Every tensor of a decode-only plan, in a fixed order (a graph's inputs)."""
    assert plan.decode is not None and not plan.prefills
    yield from (plan.token_ids, plan.positions, plan.slots, plan.logit_rows)
    decode = plan.decode
    yield from (decode.rows, decode.blocks, decode.contexts, decode.mask)


def padded_plan(batch: ForwardBatch, cache: PagedKVCache, window: int | None = None
                ) -> tuple[tuple[int, int], AttentionPlan] | None:
    """The (batch size, table width) of the graph that runs a decode-only `batch`, and the
    plan of `batch` padded to them (on the host); None for a batch no graph runs."""
    size = padded_size(batch.num_seqs)
    if size is None or any(len(tokens) != 1 for tokens in batch.token_ids):
        return None
    assert cache.pad_block is not None, "padding rows need the cache's pad block"
    context = max(start + 1 for start in batch.start_positions)
    width = max(padded_blocks(blocks_needed(context, cache.block_size)),
                max(len(table) for table in batch.block_tables))
    padded = padded_batch(batch, size, width, cache.pad_block)
    return (size, width), plan_attention(padded, cache.block_size, cache.dtype,
                                         decode_blocks=width, window=window)


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: AttentionPlan  # on the device: copied into before each replay
    logits: torch.Tensor  # written by each replay


class DecodeGraphs:
    """The captured decode steps of one model over one cache (which has a pad block)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache) -> None:
        assert cache.pad_block is not None, "padding rows need the cache's pad block"
        self.model = model
        self.cache = cache
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def replay(self, batch: ForwardBatch) -> torch.Tensor | None:
        """fp32 logits `[num_seqs, vocab]` of a decode-only `batch`, by replaying its graph
        (captured now if new); None when the batch has a prompt chunk or is too large."""
        planned = padded_plan(batch, self.cache, self.model.spec.sliding_window)
        if planned is None:
            return None
        key, plan = planned
        self.model.check_inputs(plan)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(plan)
        else:
            for static, value in zip(plan_tensors(graph.inputs), plan_tensors(plan), strict=True):
                static.copy_(value, non_blocking=True)
        graph.graph.replay()
        return graph.logits[:batch.num_seqs].clone()

    def _capture(self, plan: AttentionPlan) -> _Graph:
        """A graph of the step `plan` describes; its inputs are `plan` moved to the device, and
        the warm-up runs before capture have done that step already (the replay after it
        computes the same again)."""
        device = self.cache.device
        inputs = plan.to(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUPS):
                self.model.run(inputs, self.cache)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.run(inputs, self.cache)
        return _Graph(graph, inputs, logits)

