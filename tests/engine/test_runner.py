"""ModelRunner wiring, thread settings, and a worker's runner built from config."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from core.config import DecodeConfig, ModelConfig, SimConfig
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner, load_runner, set_threads
from engine.sim.runner import SimRunner
from engine.weights.quant_rows import MeasuredQuantRows
from engine.weights.spec import kv_fingerprint, load_spec
from tests.reference import last_hidden_state


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


@pytest.mark.parametrize("folder", ["tiny_model_dir", "tiny_qwen3_embedding_dir"])
def test_a_pass_that_asks_keeps_each_sequence_s_last_hidden_state(
        folder: str, request: pytest.FixtureRequest) -> None:
    """Of a causal LM, and of an embedding model saved from its decoder alone."""
    model_dir = request.getfixturevalue(folder)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    runner = ModelRunner(model_dir, num_blocks=4, block_size=4)
    tables = [runner.allocator.allocate(2) for _ in prompts]
    runner.forward(ForwardBatch(prompts, [0, 0], tables, hidden=True))
    assert runner.hidden.shape == (2, runner.spec.hidden_size)
    for prompt, row in zip(prompts, runner.hidden, strict=True):
        torch.testing.assert_close(row, last_hidden_state(model_dir, prompt),
                                   atol=1e-4, rtol=1e-4)


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


def test_the_kv_fingerprint_names_the_cache_dtype(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=4, block_size=8, dtype=torch.bfloat16)
    assert runner.kv_fingerprint == kv_fingerprint(load_spec(tiny_model_dir), "bfloat16")
    assert "|bfloat16|" in runner.kv_fingerprint


def quant_rows(model: ModelConfig, pool: DecodeConfig) -> int:
    """The quant row count of the runner a worker of `pool` loads."""
    runner = load_runner(model, pool)
    assert isinstance(runner, ModelRunner)
    return runner.model.quant_rows


@pytest.mark.kernels
def test_a_worker_measures_once_and_later_ones_read_it(quant_model_dir: Path,
                                                       tmp_path: Path) -> None:
    for path in quant_model_dir.iterdir():
        (tmp_path / path.name).symlink_to(path)
    model = ModelConfig(name=str(tmp_path), dtype="float32")
    pool = DecodeConfig(num_kv_blocks=4, threads=1)
    threads = torch.get_num_threads()
    try:
        first = quant_rows(model, pool)
        assert MeasuredQuantRows(tmp_path).get("float32") == first
        MeasuredQuantRows(tmp_path).put("float32", 3)
        assert quant_rows(model, pool) == 3
        assert quant_rows(dataclasses.replace(model, quant_rows=0), pool) == 0
    finally:
        torch.set_num_threads(threads)


def test_threads_zero_is_one_per_cpu_the_worker_may_run_on(tiny_model_dir: Path) -> None:
    model = ModelConfig(name=str(tiny_model_dir), dtype="float32", quant_rows=0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        load_runner(model, DecodeConfig(num_kv_blocks=4, threads=0))
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        load_runner(model, DecodeConfig(num_kv_blocks=4, threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_a_simulated_model_gets_a_sim_runner_with_its_settings(tmp_path: Path) -> None:
    model = ModelConfig(name="sim", cache_dir=str(tmp_path))
    pool = DecodeConfig(num_kv_blocks=8, block_size=4, threads=1)
    threads = torch.get_num_threads()
    try:
        runner = load_runner(model, pool, sim=SimConfig(kv_bytes=0.5, time_scale=0))
    finally:
        torch.set_num_threads(threads)
    assert isinstance(runner, SimRunner) and runner.time_scale == 0
    assert runner.allocator.num_total == 8 and runner.block_size == 4
    assert runner.spec.num_kv_heads * runner.spec.head_dim == 96  # half of 3 x 64
    assert runner.model_dir == tmp_path / "sim-default"
