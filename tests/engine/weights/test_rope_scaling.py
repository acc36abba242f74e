"""Llama 3's rope scaling recovered from the divisors llama.cpp's converter writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.weights.rope_scaling import llama3_frequencies, llama3_scaling

LLAMA_3_1 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA_3_2 = {**LLAMA_3_1, "factor": 32.0}


def divisors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """As llama.cpp's converter writes them: in fp32."""
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (plain / llama3_frequencies(plain, scaling)).numpy().astype(np.float64)


@pytest.mark.parametrize(("scaling", "head_dim"), [(LLAMA_3_1, 128), (LLAMA_3_2, 64)])
def test_llama_3s_parameters_come_back_from_their_divisors(scaling: dict,
                                                           head_dim: int) -> None:
    assert llama3_scaling(divisors(scaling, 500000.0, head_dim), 500000.0, head_dim) == scaling


def test_other_band_edges_come_back_too() -> None:
    scaling = {**LLAMA_3_1, "low_freq_factor": 1.5, "high_freq_factor": 6.0}
    assert llama3_scaling(divisors(scaling, 10000.0, 64), 10000.0, 64) == scaling


@pytest.mark.parametrize("found", [
    [1.0] * 8,  # no scaling at all
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0, 8.0],  # one divisor between: no line through it
    [1.0, 1.5, 3.0, 2.0, 8.0, 8.0, 8.0, 8.0],  # not rising with the wavelength
])
def test_divisors_of_another_kind_are_refused(found: list[float]) -> None:
    with pytest.raises(ValueError, match="not Llama 3's scaling"):
        llama3_scaling(np.array(found), 10000.0, 16)
