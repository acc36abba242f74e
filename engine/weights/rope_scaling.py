"""Llama 3's rope scaling, both ways: the frequencies its parameters give (engine.model.rope),
and its parameters from the per-frequency divisors llama.cpp's converter writes into a GGUF
as `rope_freqs.weight` (engine.weights.gguf), which transformers does not read."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

LLAMA3_ORIGINAL_LENGTH = 8192  # the length llama.cpp's converter writes the divisors for


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by `factor`, blend the middle band smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def llama3_scaling(divisors: np.ndarray, theta: float,
                   head_dim: int) -> dict[str, Any] | None:
    """The "llama3" parameters whose frequencies are the plain ones over `divisors` (None where
    every divisor is 1): 1 for high frequencies, `factor` for low ones, and between,
    `1 / ((1 - s) / factor + s)` for an `s` linear in `original length / wavelength`, whose
    line gives the two band edges."""
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"{divisors.shape[0]} rope divisors for {head_dim // 2} frequencies")
    if np.all(divisors == 1):
        return None
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(divisors.max())
    between = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if factor <= 1 or between.sum() < 2:
        raise ValueError(f"rope divisors that are not Llama 3's scaling: {divisors.tolist()}")
    smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    per_wavelength = LLAMA3_ORIGINAL_LENGTH * plain[between] / (2 * math.pi)
    slope, intercept = np.polyfit(per_wavelength, smooth, 1)
    low = round(float(-intercept / slope), 3)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": round(low + float(1 / slope), 3),
               "original_max_position_embeddings": LLAMA3_ORIGINAL_LENGTH}
    frequencies = torch.from_numpy(plain)
    if not np.allclose(frequencies / llama3_frequencies(frequencies, scaling), divisors,
                       rtol=1e-4):
        raise ValueError(f"rope divisors that are not Llama 3's scaling: {divisors.tolist()}")
    return scaling
