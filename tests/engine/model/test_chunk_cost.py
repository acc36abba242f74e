"""Chunk costs: tokens plus the keys they attend to, and the most tokens a budget buys."""

from __future__ import annotations

import math

import pytest

from engine.model.chunk_cost import ChunkCost
from engine.weights.spec import ModelSpec


def smollm2_shape() -> ModelSpec:
    return ModelSpec(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=1e5, rope_scaling=None, max_position_embeddings=8192,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name="s")


def test_keys_per_token_of_smollm2() -> None:
    """Per token: 2 x (576 x 64 x 24 + 3 x 576 x 1536) = 7,077,888 FLOPs of matrices; per key
    4 x 9 x 64 = 2,304, at half the speed: 1,536 keys cost a token."""
    assert ChunkCost.of(smollm2_shape()).keys_per_token == 1536


def test_a_chunk_deep_into_a_prompt_costs_what_one_core_measured() -> None:
    """256 tokens 3,072 in took 2.8x the time of 256 from the start (340 against 120 ms)."""
    cost = ChunkCost.of(smollm2_shape())
    assert cost.cost(3072, 256) / cost.cost(0, 256) == pytest.approx(2.83, abs=0.05)


def test_costs_count_every_key_once() -> None:
    cost = ChunkCost(keys_per_token=10)
    assert cost.cost(0, 1) == 1 + 1 / 10  # a token attends to itself
    assert cost.cost(5, 2) == 2 + (6 + 7) / 10
    assert cost.cost(0, 5) + cost.cost(5, 3) == pytest.approx(cost.cost(0, 8))
    assert cost.cost(7, 0) == 0


def test_without_keys_a_cost_is_a_token_count() -> None:
    cost = ChunkCost()
    assert cost.keys_per_token == math.inf
    assert cost.cost(10_000, 300) == 300
    assert cost.tokens_within(256, 10_000, 1000) == 256


@pytest.mark.parametrize("keys_per_token", [1.0, 7.0, 1536.0, 1e9])
@pytest.mark.parametrize("start", [0, 1, 100, 3000, 8000])
@pytest.mark.parametrize("budget", [0.5, 1.0, 17.0, 256.0, 512.0, 1e6])
def test_tokens_within_is_the_most_the_budget_buys(keys_per_token: float, start: int,
                                                   budget: float) -> None:
    cost = ChunkCost(keys_per_token)
    count = cost.tokens_within(budget, start, 10_000)
    assert count == 10_000 or cost.cost(start, count + 1) > budget
    assert cost.cost(start, count) <= budget


def test_tokens_within_stops_at_what_is_pending() -> None:
    cost = ChunkCost(keys_per_token=1536)
    assert cost.tokens_within(512, 0, 40) == 40
    assert cost.tokens_within(512, 0, 0) == 0
    assert cost.tokens_within(0, 0, 40) == 0
    assert cost.tokens_within(-3, 0, 40) == 0


def test_deeper_chunks_get_fewer_tokens() -> None:
    cost = ChunkCost.of(smollm2_shape())
    counts = [cost.tokens_within(256, start, 10_000) for start in (0, 1024, 2048, 3072, 8000)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[3] > 0
