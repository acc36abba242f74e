"""A GGUF matrix of any quantized type as one of our two quant block formats
(engine.weights.quant_blocks), so that no GGUF model is ever widened to a dense copy:

- Q4_1 and Q8_0 are kept as they are;
- Q4_0 becomes Q4_1 exactly (`m = -8 d`, a power of two away from `d`);
- Q4_K becomes Q4_1 with the same 4-bit values: a Q4_K super-block holds eight 32-value
  sub-blocks, each `d * sc * q - dmin * m` with 6-bit `sc` and `m`, which is a Q4_1 quant block
  with `d * sc` and `-dmin * m` as its fp16 `d` and `m`. Those two products are rounded to fp16
  (a relative error of at most 2^-11 of a scale; transformers keeps them in fp32);
- Q5_0 and IQ4_NL become Q8_0 exactly: each of their 32-value blocks is its fp16 `d` times
  integers of int8's range (`q - 16`; a table's entries);
- every other quantized type (Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, the other IQ types) is dequantized
  and quantized again to Q8_0 (a block's step its largest value over 127, in fp16): each value
  moves by at most half a step, 1/254 of the block's largest value, plus what the step's
  rounding to fp16 costs at the clamp (2^-11 of that value; for a block under about 1e-3,
  whose step is subnormal, up to 4e-6). Q6_K, for one, cannot be held exactly: the two
  16-value halves of a 32-value block have scales of their own;
- F32, F16 and BF16 matrices are left dense.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from engine.weights.quant_blocks import QUANT_BLOCK, quantize

Kind = GGMLQuantizationType
DENSE_KINDS = frozenset({Kind.F32, Kind.F16, Kind.BF16, Kind.F64})
KEPT = {Kind.Q4_1: 4, Kind.Q8_0: 8}  # our formats: bits per value
_Q4_K_SCALES = slice(4, 16)  # after fp16 d and dmin: 12 bytes of 6-bit scales and mins
# 32 values a block, each its first two bytes (fp16 d) times an integer of int8's range
_SCALED_INTEGERS = frozenset({Kind.Q5_0, Kind.IQ4_NL})


def quant_blocks_of(data: np.ndarray, kind: Kind) -> tuple[np.ndarray, int] | None:
    """The quant blocks `[rows, bytes]` and bits of a GGUF matrix's raw blocks `data`
    `[rows, bytes]` of type `kind`; None for a dense type."""
    if kind in DENSE_KINDS:
        return None
    if kind in KEPT:
        return data, KEPT[kind]
    if kind == Kind.Q4_0:
        return _q4_0_as_q4_1(data), 4
    if kind == Kind.Q4_K:
        return _q4_k_as_q4_1(data), 4
    if kind in _SCALED_INTEGERS:
        return _scaled_integers_as_q8_0(data, kind), 8
    return _as_q8_0(data, kind), 8


def conversion(kind: Kind) -> str:
    """How a matrix of type `kind` is kept, in a few words (for the prepared folder's record)."""
    if kind in DENSE_KINDS:
        return f"{kind.name}: dense"
    if kind in KEPT:
        return f"{kind.name}: as it is"
    if kind in (Kind.Q4_0, Kind.Q4_K):
        return f"{kind.name}: as Q4_1"
    if kind in _SCALED_INTEGERS:
        return f"{kind.name}: as Q8_0"
    return f"{kind.name}: quantized again as Q8_0"


def _q4_0_as_q4_1(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(-1, GGML_QUANT_SIZES[Kind.Q4_0][1])
    d = blocks[:, 0:2].view(np.float16)
    m = (d.astype(np.float32) * -8).astype(np.float16)
    return np.concatenate([blocks[:, 0:2], m.view(np.uint8), blocks[:, 2:]],
                          axis=1).reshape(data.shape[0], -1)


def _q4_k_as_q4_1(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(-1, GGML_QUANT_SIZES[Kind.Q4_K][1])
    count = blocks.shape[0]
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(blocks[:, _Q4_K_SCALES])  # [count, 8] each
    # exact in fp32 (11-bit d times 6-bit sc), then rounded once to fp16
    q4_1_d = (d * scales.astype(np.float32)).astype(np.float16)
    q4_1_m = (-(dmin * mins.astype(np.float32))).astype(np.float16)
    # four 32-byte runs of 64 values: low nibbles hold one sub-block, high nibbles the next
    runs = blocks[:, 16:].reshape(count, 4, 1, QUANT_BLOCK)
    values = np.concatenate([runs & 0xF, runs >> 4], axis=2).reshape(count, 8, QUANT_BLOCK)
    half = QUANT_BLOCK // 2  # Q4_1: low nibbles values 0-15, high nibbles 16-31
    packed = values[..., :half] | (values[..., half:] << 4)
    parts = [q4_1_d.view(np.uint8).reshape(count, 8, 2),
             q4_1_m.view(np.uint8).reshape(count, 8, 2), packed]
    return np.concatenate(parts, axis=2).reshape(data.shape[0], -1)


def _scaled_integers_as_q8_0(data: np.ndarray, kind: Kind) -> np.ndarray:
    blocks = data.reshape(-1, GGML_QUANT_SIZES[kind][1]).copy()
    d = blocks[:, 0:2].copy()
    blocks[:, 0:2] = np.ones((len(blocks), 1), np.float16).view(np.uint8)
    integers = dequantize(blocks, kind).reshape(len(blocks), QUANT_BLOCK)
    assert np.abs(integers).max() <= 127, f"{kind.name} values beyond int8's range"
    return np.concatenate([d, integers.astype(np.int8).view(np.uint8)],
                          axis=1).reshape(data.shape[0], -1)


def _as_q8_0(data: np.ndarray, kind: Kind, rows_at_once: int = 4096) -> np.ndarray:
    """Dequantized and quantized again a few rows at a time: a whole large matrix in fp32
    would cost four bytes a value at once."""
    parts = []
    for start in range(0, data.shape[0], rows_at_once):
        values = dequantize(data[start:start + rows_at_once], kind)
        parts.append(quantize(torch.from_numpy(np.ascontiguousarray(values, np.float32)),
                              8).packed.numpy())
    return np.concatenate(parts)
