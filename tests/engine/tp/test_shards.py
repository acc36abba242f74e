"""A rank's share of a model: which heads, rows and columns, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tp.shards import Shard
from engine.weights.load import load_weights
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
    with pytest.raises(ValueError, match="model.tp=3 does not divide the model's 4 attention"):
        Shard(0, 3, load_spec(tiny_model_dir))
    with pytest.raises(ValueError, match="2 KV heads"):
        Shard(0, 4, load_spec(tiny_model_dir))
