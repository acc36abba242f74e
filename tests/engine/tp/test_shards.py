"""A rank's share of a model: which heads, rows and columns, and refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.tp.shards import Shard
from engine.weights.load import load_weights
from engine.weights.quant_blocks import dequantize, load_quant_blocks
from engine.weights.spec import load_spec


def test_each_rank_takes_its_heads_and_mlp_columns(tiny_qwen2_dir: Path) -> None:
    spec = load_spec(tiny_qwen2_dir)  # 4 heads of 16, 2 KV heads, 128 MLP columns, biases
    weights = load_weights(tiny_qwen2_dir, torch.float32)
    layer = "model.layers.1."
    shares = [Shard(rank, 2, spec).weights(weights) for rank in range(2)]
    for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.k_proj.bias", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.up_proj.weight", 0),
                      ("mlp.down_proj.weight", 1)):
        whole = weights[layer + name]
        assert torch.equal(torch.cat([share[layer + name] for share in shares], dim), whole)
        assert shares[1][layer + name].shape[dim] * 2 == whole.shape[dim]
    for name in ("model.embed_tokens.weight", layer + "input_layernorm.weight"):
        assert all(share[name] is weights[name] for share in shares)
    local = Shard(1, 2, spec).local_spec()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert Shard(1, 2, spec).kv_heads == (1, 2)


def test_a_split_that_does_not_divide_the_heads_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.tp=3 does not divide the model's 4 attention"):
        Shard(0, 3, load_spec(tiny_model_dir))
    with pytest.raises(ValueError, match="2 KV heads"):
        Shard(0, 4, load_spec(tiny_model_dir))


def test_quant_blocks_split_as_the_dense_weights_do(quant_model_dir: Path) -> None:
    spec = load_spec(quant_model_dir)
    blocks = load_quant_blocks(quant_model_dir)
    dense = load_weights(quant_model_dir, torch.float32)
    layer = "model.layers.0."
    for rank in range(2):
        shard = Shard(rank, 2, spec)
        quant, weights = shard.quant(blocks), shard.weights(dense)
        assert quant is not None
        for name in ("self_attn.k_proj.weight", "self_attn.o_proj.weight",
                     "mlp.down_proj.weight"):
            assert torch.equal(dequantize(quant[layer + name]), weights[layer + name])
        for name, shared in (("mlp.gate_proj.weight", True), ("mlp.down_proj.weight", False)):
            storage = quant[layer + name].packed.untyped_storage().data_ptr()
            mapped = blocks[layer + name].packed.untyped_storage().data_ptr()
            assert (storage == mapped) == shared  # rows: a view of the file; columns: a copy


def test_columns_that_do_not_split_into_whole_quant_blocks_leave_them_whole(
        make_tiny_model: Callable[..., Path]) -> None:
    spec = load_spec(make_tiny_model(intermediate_size=96))  # 48 columns a rank
    assert Shard(0, 2, spec).quant({}) is None
