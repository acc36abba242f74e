"""ModelRunner wiring and thread settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.batch import ForwardBatch
from engine.runner import ModelRunner, set_threads


def test_runner_holds_a_matching_model_cache_and_allocator(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=16, block_size=8, dtype=torch.bfloat16)
    assert runner.block_size == 8 and runner.allocator.num_total == 16
    assert runner.cache.k.dtype == torch.bfloat16 and runner.cache.num_blocks == 16
    assert runner.spec.num_layers == 2 and runner.model.spec is runner.spec
    table = runner.allocator.allocate(2)
    layers: list[int] = []
    logits = runner.forward(ForwardBatch([[5, 6, 7]], [0], [table]), layer_hook=layers.append)
    assert logits.shape == (1, 49152) and logits.dtype == torch.float32
    assert layers == [0, 1]
    assert runner.cache.read(table, 3)[0].abs().sum() > 0


def test_bf16_runner_agrees_with_fp32_on_greedy_tokens(tiny_model_dir: Path) -> None:
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    tokens = []
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(tiny_model_dir, num_blocks=4, block_size=4, dtype=dtype)
        tables = [runner.allocator.allocate(2) for _ in prompts]
        logits = runner.forward(ForwardBatch(prompts, [0, 0], tables))
        tokens.append(logits.argmax(dim=-1).tolist())
    assert tokens[0] == tokens[1]


def test_set_threads() -> None:
    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        set_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError):
        set_threads(0)
