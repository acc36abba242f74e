"""Rotary position embeddings with the config's scaling, as transformers computes them."""

from __future__ import annotations

import torch

from engine.kernels.cpu.build import kernels_for
from engine.weights.rope_scaling import llama3_frequencies
from engine.weights.spec import ModelSpec


def inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    """`[head_dim // 2]` rotation frequencies, scaled per `spec.rope_scaling` (a dynamic
    scaling's within its original length: unscaled)."""
    inv_freq = _frequencies(spec.rope_theta, spec.head_dim)
    scaling = spec.rope_scaling or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return llama3_frequencies(inv_freq, scaling)
    assert rope_type in ("default", "dynamic"), rope_type
    return inv_freq


def _frequencies(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    """Plain RoPE frequencies `[..., dim // 2]` for a base `theta` (`[...]` bases: one row
    each)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if isinstance(theta, torch.Tensor):
        return 1.0 / (theta[:, None] ** exponents)
    return 1.0 / (theta ** exponents)


def _dynamic_angles(spec: ModelSpec, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK scaling's angles `[positions, head_dim // 2]`: each token is rotated at the
    base for the sequence up to itself, as transformers rotates a sequence fed one token at a
    time (its one-pass prefill of a prompt past the original length rotates every token at
    the prompt's length, which would make a token's KV depend on how its prompt was cut)."""
    scaling = spec.rope_scaling
    assert scaling is not None
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    lengths = torch.clamp(positions + 1, min=original)
    dim = spec.head_dim
    bases = spec.rope_theta * ((factor * lengths / original) - (factor - 1)) ** (dim / (dim - 2))
    return positions[:, None] * _frequencies(bases, dim)


def settle_vector_math() -> None:
    """Have MKL's vector math (torch's cos, sin, exp... on CPU tensors) pick its code path on
    this thread alone. It picks on its first call in a process, and where two threads make that
    call at once (a table split into parallel chunks), one of them can compute its chunk at
    far lower accuracy: about one process in eight built a cos table 1.5e-4 off in half its
    rows (torch 2.13, two threads). One call of one element settles it for every function
    and thread."""
    torch.exp(torch.zeros(1))


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position up to max_position_embeddings."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        settle_vector_math()
        positions = torch.arange(spec.max_position_embeddings, dtype=torch.float)
        if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "dynamic":
            freqs = _dynamic_angles(spec, positions)
        else:
            freqs = positions[:, None] * inverse_frequencies(spec)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[N, 1, head_dim]` of token `positions` `[N]`, broadcastable over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[N, heads, head_dim]` by the angles whose cos/sin `lookup` returned."""
    module = kernels_for(x, cos, sin)
    if module is not None and x.stride(-1) == 1:
        return module.rope(x, cos, sin)  # one pass, in fp32; torch's takes six kernels
    return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope in torch ops, as transformers writes it."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
