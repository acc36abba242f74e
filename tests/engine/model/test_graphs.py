"""Decode steps as fixed shapes: padding rows and block tables change no real row's logits
(checked on the CPU, through the same plan a CUDA graph is fed); on a GPU, replayed graphs
give the eager pass's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv.allocator import BlockAllocator
from engine.kv.cache import PagedKVCache
from engine.model.batch import ForwardBatch
from engine.model.graphs import BATCH_SIZES, DecodeGraphs, padded_blocks, padded_plan, padded_size
from engine.runner import ModelRunner

BLOCK_SIZE = 4


def test_batch_sizes_and_widths_round_up() -> None:
    assert [padded_size(n) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 24, 64]
    assert padded_size(BATCH_SIZES[-1] + 1) is None
    assert [padded_blocks(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def prefilled(runner: ModelRunner, cache: PagedKVCache, allocator: BlockAllocator,
              lengths: list[int]) -> ForwardBatch:
    """A decode step of sequences of `lengths` cached tokens (prefilled now into `cache`)."""
    tables = [allocator.allocate(-(-(n + 1) // BLOCK_SIZE)) for n in lengths]
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    runner.model.forward(ForwardBatch(prompts, [0] * len(prompts), tables), cache)
    return ForwardBatch([[i + 3] for i in range(len(lengths))], lengths, tables)


def test_padding_changes_no_real_rows_logits(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    cache = PagedKVCache(runner.spec, 64, BLOCK_SIZE, torch.float32, pad_block=True)
    allocator = BlockAllocator(64)
    step = prefilled(runner, cache, allocator, [9, 2, 5])
    planned = padded_plan(step, cache)
    assert planned is not None
    (size, width), plan = planned
    assert (size, width) == (4, 4) and plan.decode is not None
    assert plan.decode.blocks.shape == (4, 4)
    assert int(plan.slots[-1]) == cache.num_blocks * BLOCK_SIZE  # the pad block's first slot
    padded = runner.model.run(plan, cache)[:3]
    eager = runner.model.forward(step, cache)  # writes the same K/V again: same logits
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)


def test_prompt_chunks_are_not_graphed(tiny_model_dir: Path) -> None:
    cache = PagedKVCache(ModelRunner(tiny_model_dir, 4, BLOCK_SIZE).spec, 4, BLOCK_SIZE,
                         torch.float32, pad_block=True)
    assert padded_plan(ForwardBatch([[1, 2]], [0], [[0]]), cache) is None


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason=f"CUDA graphs need a GPU: torch {torch.__version__} sees none")
def test_replayed_cuda_graphs_give_the_eager_logits(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=128, block_size=BLOCK_SIZE, device="cuda")
    graphs = runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    for lengths in ([3], [9, 2, 5], [9, 2, 5], [40, 1, 7, 7, 7], [3]):
        step = prefilled(runner, runner.cache, runner.allocator, lengths)
        replayed = graphs.replay(step)
        assert replayed is not None
        eager = runner.model.forward(step, runner.cache)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        for table in step.block_tables:
            runner.allocator.free(table)
    assert len(graphs.graphs) == 3  # (1, 1), (4, 4), (8, 16): a repeated shape is replayed
