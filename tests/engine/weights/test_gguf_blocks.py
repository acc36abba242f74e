"""Every quantized GGUF type as our quant blocks: kept, converted exactly (Q4_0, Q5_0, IQ4_NL),
with only fp16-rounded scales (Q4_K), or quantized again as Q8_0 within half a step; dense
types not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf.quants import Q4_K, dequantize

from bench.gguf import quant_row_bytes, random_blocks
from engine.weights.gguf_blocks import _as_q8_0, conversion, quant_blocks_of
from engine.weights.quant_blocks import QUANT_BLOCK, QuantMatrix
from engine.weights.quant_blocks import dequantize as dequantize_ours

ROWS, COLUMNS = 8, 512
FP16_ROUNDING = 2.0 ** -11  # the most a value rounded to fp16 moves, relative to itself


def blocks(kind: Kind, seed: int = 0) -> np.ndarray:
    return random_blocks(np.random.default_rng(seed), kind, ROWS, COLUMNS, 0.02)


def ours_and_gguf(data: np.ndarray, kind: Kind) -> tuple[np.ndarray, np.ndarray, int]:
    """Our blocks' values, the GGUF's own values and our bits, both `[ROWS, COLUMNS]`."""
    converted = quant_blocks_of(data, kind)
    assert converted is not None
    packed, bits = converted
    assert packed.shape == (ROWS, quant_row_bytes(Kind.Q4_1 if bits == 4 else Kind.Q8_0,
                                                  COLUMNS))
    ours = dequantize_ours(QuantMatrix(torch.from_numpy(packed.copy()), bits)).numpy()
    return ours, dequantize(data, kind), bits


@pytest.mark.parametrize("kind", [Kind.Q4_1, Kind.Q8_0])
def test_our_own_formats_are_kept_byte_for_byte(kind: Kind) -> None:
    data = blocks(kind)
    converted = quant_blocks_of(data, kind)
    assert converted is not None and converted[0] is data
    assert conversion(kind) == f"{kind.name}: as it is"


def test_q4_0_becomes_q4_1_exactly() -> None:
    ours, theirs, bits = ours_and_gguf(blocks(Kind.Q4_0), Kind.Q4_0)
    assert bits == 4 and np.array_equal(ours, theirs)


@pytest.mark.parametrize("kind", [Kind.Q5_0, Kind.IQ4_NL])
def test_types_of_scaled_integers_become_q8_0_exactly(kind: Kind) -> None:
    ours, theirs, bits = ours_and_gguf(blocks(kind), kind)
    assert bits == 8 and conversion(kind) == f"{kind.name}: as Q8_0"
    assert np.array_equal(ours, theirs)


def test_q4_k_becomes_q4_1_with_only_its_scales_rounded_to_fp16() -> None:
    data = blocks(Kind.Q4_K)
    ours, theirs, bits = ours_and_gguf(data, Kind.Q4_K)
    assert bits == 4
    super_blocks = data.reshape(-1, 144)
    d = super_blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = super_blocks[:, 2:4].view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(super_blocks[:, 4:16])
    # a 32-value block's d * sc and dmin * m each move by at most a rounding to fp16
    bound = FP16_ROUNDING * (15 * np.abs(d * scales) + np.abs(dmin * mins))
    error = np.abs(ours - theirs).reshape(-1, 8, QUANT_BLOCK).max(axis=-1)
    assert (error <= bound.reshape(error.shape)).all()
    assert error.max() > 0  # rounded indeed: not every scale fits fp16
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()


@pytest.mark.parametrize("kind", [Kind.Q5_1, Kind.Q2_K, Kind.Q3_K, Kind.Q5_K, Kind.Q6_K,
                                  Kind.IQ4_XS])
def test_other_types_are_quantized_again_as_q8_0_within_half_a_step(kind: Kind) -> None:
    ours, theirs, bits = ours_and_gguf(blocks(kind), kind)
    assert bits == 8 and conversion(kind) == f"{kind.name}: quantized again as Q8_0"
    largest = np.abs(theirs).reshape(-1, QUANT_BLOCK).max(axis=-1, keepdims=True)
    # half a step of 1/127 of the largest value, its step rounded to fp16
    bound = largest / 254 + largest * FP16_ROUNDING
    assert (np.abs(ours - theirs).reshape(-1, QUANT_BLOCK) <= bound).all()


def test_a_matrix_is_quantized_again_a_few_rows_at_a_time_as_it_is_whole() -> None:
    data = blocks(Kind.Q6_K)
    assert np.array_equal(_as_q8_0(data, Kind.Q6_K, rows_at_once=3),
                          _as_q8_0(data, Kind.Q6_K))


@pytest.mark.parametrize("kind", [Kind.F32, Kind.F16, Kind.BF16])
def test_dense_types_stay_dense(kind: Kind) -> None:
    assert quant_blocks_of(np.zeros((ROWS, COLUMNS), np.float32), kind) is None
    assert conversion(kind) == f"{kind.name}: dense"
