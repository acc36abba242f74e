"""Llama 3's rope scaling recovered from the divisors llama.cpp's converter writes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.weights.rope_scaling import llama3_scaling

LLAMA_3_1 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA_3_2 = {**LLAMA_3_1, "factor": 32.0}


def divisors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """As llama.cpp's converter (convert_hf_to_gguf.py) writes them, in fp32."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    found = []
    for frequency in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            found.append(1.0)
        elif wavelength > original / low:
            found.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            found.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(found, np.float32).astype(np.float64)


@pytest.mark.parametrize(("scaling", "head_dim"), [(LLAMA_3_1, 128), (LLAMA_3_2, 64)])
def test_llama_3s_parameters_come_back_from_their_divisors(scaling: dict,
                                                           head_dim: int) -> None:
    assert llama3_scaling(divisors(scaling, 500000.0, head_dim), 500000.0, head_dim) == scaling


def test_other_band_edges_come_back_too() -> None:
    scaling = {**LLAMA_3_1, "low_freq_factor": 1.5, "high_freq_factor": 6.0}
    assert llama3_scaling(divisors(scaling, 10000.0, 64), 10000.0, 64) == scaling


def test_divisors_of_one_are_no_scaling() -> None:
    assert llama3_scaling(np.ones(8), 10000.0, 16) is None


@pytest.mark.parametrize(("found", "message"), [
    ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0, 8.0], "not Llama 3's"),  # one between: no line
    ([1.0, 1.5, 3.0, 2.0, 8.0, 8.0, 8.0, 8.0], "not Llama 3's"),  # not rising with wavelength
    ([1.0, 2.0, 8.0], "3 rope divisors for 8 frequencies"),
])
def test_divisors_of_another_kind_are_refused(found: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama3_scaling(np.array(found), 10000.0, 16)
