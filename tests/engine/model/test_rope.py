"""RoPE frequencies and rotation against transformers' implementation."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.model.rope import RotaryEmbedding, apply_rope, inverse_frequencies
from engine.weights.spec import load_spec

SCALINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "dynamic": {"factor": 2.0},
    "linear": {"factor": 3.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


def config_for(rope_type: str) -> LlamaConfig:
    parameters = {"rope_type": rope_type, "rope_theta": 5e5, **SCALINGS[rope_type]}
    return LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=4096, rope_parameters=parameters)


@pytest.fixture(params=sorted(SCALINGS))
def rope_type(request: pytest.FixtureRequest) -> str:
    return request.param


def test_inverse_frequencies_match(rope_type: str, tmp_path: Path) -> None:
    config = config_for(rope_type)
    config.save_pretrained(tmp_path)
    unscaled = LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    expected = ROPE_INIT_FUNCTIONS[rope_type](config)[0] if rope_type != "default" else unscaled
    ours = inverse_frequencies(load_spec(tmp_path))
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0)
    # dynamic scaling changes nothing within the original length
    assert torch.equal(ours, unscaled) == (rope_type in ("default", "dynamic"))


def test_rotation_matches(rope_type: str, tmp_path: Path) -> None:
    config = config_for(rope_type)
    config.save_pretrained(tmp_path)
    positions = torch.tensor([0, 1, 5, 300, 4095])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2, 128, generator=g), torch.randn(5, 1, 128, generator=g)
    cos, sin = RotaryEmbedding(load_spec(tmp_path), torch.float32).lookup(positions)
    ours = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    theirs = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.allclose(mine, reference[0].transpose(0, 1), atol=1e-5)


def test_dynamic_rotation_past_the_original_length_is_transformers_one_token_at_a_time(
        tmp_path: Path) -> None:
    config = config_for("dynamic")
    config.save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    assert spec.max_position_embeddings == 8192
    positions = [4095, 4096, 4097, 5000, 8191]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(positions), 2, 128, generator=g)
    cos, sin = RotaryEmbedding(spec, torch.float32).lookup(torch.tensor(positions))
    ours = apply_rope(q, cos, sin)
    cos, sin = LlamaRotaryEmbedding(config_for("default"))(q, torch.tensor([positions]))
    unscaled = apply_rope(q, cos[0][:, None], sin[0][:, None])
    assert not torch.allclose(ours[3:], unscaled[3:], atol=1e-2)
    for row, position in enumerate(positions):
        # a fresh module: transformers keeps the longest length it has seen
        cos, sin = LlamaRotaryEmbedding(config)(q, torch.tensor([[position]]))
        theirs = apply_rotary_pos_emb(q[row:row + 1].transpose(0, 1)[None], q[:1, :1], cos, sin)
        assert torch.allclose(ours[row], theirs[0][0].transpose(0, 1)[0], atol=1e-4)


FRESH_PROCESS_TABLE = """
import sys, torch
from engine.model.rope import RotaryEmbedding, inverse_frequencies
from engine.weights.spec import load_spec
torch.set_num_threads(2)
spec = load_spec(sys.argv[1])
table = RotaryEmbedding(spec, torch.float32).cos[:, :spec.head_dim // 2]
angles = torch.arange(spec.max_position_embeddings, dtype=torch.float)[:, None] \\
    * inverse_frequencies(spec)[None, :]
print((table.double() - angles.double().cos()).abs().max().item())
"""


def test_the_tables_are_exact_in_every_fresh_process(tmp_path: Path) -> None:
    """The table is a process's first cos, in two parallel chunks (2,048 positions of 16
    dimensions), one a thread. Before MKL's vector math was settled first
    (rope.settle_vector_math), about one process in twelve to eight had half the table 1.5e-4
    off, and 20 processes caught one about four times in five."""
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}).save_pretrained(
                    tmp_path)
    command = [sys.executable, "-c", FRESH_PROCESS_TABLE, str(tmp_path)]

    def error(_: int) -> float:
        return float(subprocess.run(command, capture_output=True, text=True, check=True,
                                    timeout=120).stdout)

    with ThreadPoolExecutor(2) as pool:  # two processes at once: each is mostly torch's import
        errors = list(pool.map(error, range(20)))
    assert max(errors) < 1e-6, errors
