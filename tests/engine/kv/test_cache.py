"""The paged KV cache: slot mapping and write/read round trips across block boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv.cache import PagedKVCache
from engine.weights.spec import ModelSpec, load_spec

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path) -> ModelSpec:
    return load_spec(tiny_model_dir)


def random_kv(spec: ModelSpec, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, num_tokens, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_shapes_and_bytes_per_token(spec: ModelSpec) -> None:
    cache = PagedKVCache(spec, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    assert cache.k[0].shape == (8 * BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    assert len(cache.v) == spec.num_layers
    assert cache.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2


def test_slots_follow_the_block_table(spec: ModelSpec) -> None:
    cache = PagedKVCache(spec, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float32)
    slots = cache.slots([5, 2, 7], 2, 10)
    assert slots.tolist() == [22, 23, 8, 9, 10, 11, 28, 29]
    with pytest.raises(ValueError):
        cache.slots([5, 2, 7], 0, 13)


def test_write_read_round_trip_across_blocks(spec: ModelSpec) -> None:
    cache = PagedKVCache(spec, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float32)
    table = [9, 3, 14, 0, 6]
    k, v = random_kv(spec, 19, seed=0)
    cache.write(table, 0, k[:, :6], v[:, :6])
    cache.write(table, 6, k[:, 6:], v[:, 6:])  # starts mid-block
    read_k, read_v = cache.read(table, 19)
    assert read_k.is_contiguous() and torch.equal(read_k, k) and torch.equal(read_v, v)
    layer_k, layer_v = cache.read_layers(1, 2, table, 19)
    assert torch.equal(layer_k, k[1:2]) and torch.equal(layer_v, v[1:2])
    assert layer_k.is_contiguous()
    tail_k, tail_v = cache.read_layers(0, 2, table, 19, token_start=5)  # from mid-block on
    assert torch.equal(tail_k, k[:2, 5:]) and torch.equal(tail_v, v[:2, 5:])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[table] = False
    paged = cache.k.view(spec.num_layers, 16, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    assert paged[:, untouched].abs().sum() == 0


def test_sequences_do_not_overwrite_each_other(spec: ModelSpec) -> None:
    cache = PagedKVCache(spec, num_blocks=8, block_size=BLOCK_SIZE, dtype=torch.float32)
    (k1, v1), (k2, v2) = random_kv(spec, 7, seed=1), random_kv(spec, 5, seed=2)
    cache.write([4, 1], 0, k1, v1)
    cache.write([0, 6], 0, k2, v2)
    cache.write_layer(0, [0, 6], 5, k2[0, :3], v2[0, :3])
    assert torch.equal(cache.read([4, 1], 7)[0], k1)
    assert torch.equal(cache.read([0, 6], 8)[1][0, 5:], v2[0, :3])


def test_write_rejects_bad_shapes_and_dtypes(spec: ModelSpec) -> None:
    cache = PagedKVCache(spec, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32)
    k, v = random_kv(spec, 3, seed=3)
    with pytest.raises(ValueError):
        cache.write([0], 0, k, v, layer_start=1)  # past the last layer
    with pytest.raises(ValueError):
        cache.write([0], 0, k[0], v[0])  # no layer dimension
    with pytest.raises(ValueError):
        cache.write([0], 0, k.half(), v.half())
    with pytest.raises(ValueError):
        cache.write([0], 2, k, v)  # 5 tokens do not fit one block


def test_writing_layer_by_layer_equals_writing_all_layers(spec: ModelSpec) -> None:
    k, v = random_kv(spec, 2 * BLOCK_SIZE - 1, seed=4)
    whole = PagedKVCache(spec, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32)
    whole.write([3, 1], 0, k, v)
    by_layer = PagedKVCache(spec, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32)
    for layer in reversed(range(spec.num_layers)):
        by_layer.write([3, 1], 0, k[layer:layer + 1], v[layer:layer + 1], layer_start=layer)
    assert torch.equal(whole.k, by_layer.k) and torch.equal(whole.v, by_layer.v)
