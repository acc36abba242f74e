"""Quant blocks: llama.cpp's Q4_1 and Q8_0 found again bit for bit, and the C++ product
over them equal to the product with the dequantized weight."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from engine.weights.files import EMBED, LM_HEAD, QUANT_FILE
from engine.weights.load import load_weights
from engine.weights.quant_blocks import (
    QUANT_BLOCK_BYTES,
    QuantMatrix,
    dequantize,
    exact_quant,
    load_quant_blocks,
    quantize,
    write_quant_blocks,
)

needs_kernels = pytest.mark.kernels


def random_weight(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_blocks_hold_the_weight_to_within_half_a_step(bits: int) -> None:
    weight = random_weight(8, 96)
    matrix = quantize(weight, bits)
    assert matrix.shape == (8, 96) and matrix.packed.shape == (8, 3 * QUANT_BLOCK_BYTES[bits])
    per_block = weight.reshape(8, 3, 32)
    span = per_block.amax(-1) - per_block.amin(-1) if bits == 4 else per_block.abs().amax(-1)
    step = span / (15 if bits == 4 else 127)
    error = (dequantize(matrix) - weight).abs().reshape(8, 3, 32).amax(-1)
    assert (error <= step * 0.51).all()  # half a step, and fp16 rounding of d and m


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_a_dequantized_matrix_finds_the_same_quant_blocks(bits: int) -> None:
    matrix = quantize(random_weight(16, 64, seed=bits), bits)
    again = quantize(dequantize(matrix), bits)
    assert torch.equal(again.packed, matrix.packed)


def test_exact_quant_picks_the_fewest_bits_that_reproduce_the_weight() -> None:
    four = dequantize(quantize(random_weight(4, 64), 4))
    eight = dequantize(quantize(random_weight(4, 64, seed=1), 8))
    in_four, in_eight = exact_quant(four), exact_quant(eight)
    assert in_four is not None and in_four.bits == 4
    assert in_eight is not None and in_eight.bits == 8
    assert exact_quant(random_weight(4, 64)) is None  # never quantized
    assert exact_quant(four[:, :48]) is None  # rows do not split into quant blocks
    assert exact_quant(four.to(torch.bfloat16)) is None


def test_a_quant_block_of_equal_values_is_exact() -> None:
    weight = torch.full((2, 32), 0.25)
    matrix = exact_quant(weight)
    assert matrix is not None and torch.equal(dequantize(matrix), weight)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 21, 33, 64])
def test_fp32_product_equals_the_dequantized_product(every_isa: str, bits: int,
                                                    rows: int) -> None:
    """Tiles of up to 8 rows widen blocks in registers; more rows multiply panels of 24 or 32
    widened weight rows: 50 rows end in a partial group of 4 and a partial panel."""
    matrix = quantize(random_weight(50, 160, seed=rows), bits)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(100 + rows))
    out = matrix.multiply(x)
    assert out.shape == (rows, 50) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, dequantize(matrix)), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 21, 40])
def test_bf16_product_stays_within_bf16_rounding(every_isa: str, rows: int) -> None:
    """With AVX512-BF16 the quant blocks are rounded to bf16, as the dense bf16 weights are."""
    matrix = quantize(random_weight(64, 576), 4)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    out = matrix.multiply(x)
    assert out.shape == (rows, 64) and out.dtype == torch.bfloat16
    bf16_weight = dequantize(matrix).to(torch.bfloat16).float()
    torch.testing.assert_close(out.float(), F.linear(x.float(), bf16_weight), rtol=1e-2,
                               atol=1e-2)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 products see it: each quant block of 32 values rounded to 255 steps of
    its largest magnitude."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127)
    return (q * d).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_equals_the_product_of_the_rounded_inputs(every_isa: str, bits: int,
                                                              rows: int,
                                                              dtype: torch.dtype) -> None:
    weight = quantize(random_weight(22, 160, seed=rows), bits)  # 22 rows: a partial group of 4
    matrix = QuantMatrix(weight.packed, bits, int8_inputs=True)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(7 + rows)).to(dtype)
    x[0, :32] = 0.0  # a block of zeros: scale 0
    out = matrix.multiply(x)
    assert out.shape == (rows, 22) and out.dtype == dtype
    expected = F.linear(int8_rows(x.float()), dequantize(weight))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    exact = F.linear(x.float(), dequantize(weight))
    assert (out.float() - exact).norm() <= 0.01 * exact.norm()  # what 8-bit inputs cost


@needs_kernels
def test_the_kernel_refuses_a_weight_of_the_wrong_width(cpu_kernels: ModuleType) -> None:
    matrix = quantize(random_weight(8, 64), 4)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernels.quant_linear(torch.randn(1, 96), matrix.packed, 4)


def test_the_quant_file_holds_every_exact_weight_once(quant_model_dir: Path) -> None:
    weights = load_weights(quant_model_dir, torch.float32)
    quant = load_quant_blocks(quant_model_dir)
    assert LM_HEAD not in quant  # tied: the embedding's quant blocks serve
    assert quant[EMBED].bits == 8
    matrices = [name for name, weight in weights.items() if weight.dim() == 2 and name != LM_HEAD]
    assert sorted(quant) == sorted(matrices)
    for name, matrix in quant.items():
        assert torch.equal(dequantize(matrix), weights[name]), name


def test_a_model_never_quantized_has_an_empty_quant_file(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    for path in tiny_model_dir.iterdir():
        (tmp_path / path.name).symlink_to(path)
    assert write_quant_blocks(tmp_path) == 0
    assert (tmp_path / QUANT_FILE).exists() and load_quant_blocks(tmp_path) == {}


def test_no_quant_file_means_no_quant_blocks(tmp_path: Path) -> None:
    assert load_quant_blocks(tmp_path) == {}


def test_a_quant_matrix_checks_its_own_shape() -> None:
    with pytest.raises(AssertionError):
        QuantMatrix(torch.zeros(2, 21, dtype=torch.uint8), 4)


@pytest.mark.realmodel
def test_every_matrix_of_the_real_model_is_its_gguf_quant_blocks(real_model_dir: Path) -> None:
    """SmolLM2's GGUF stores the layers' matrices as Q4_1 and the embedding as Q8_0."""
    weights, quant = load_weights(real_model_dir, torch.float32), load_quant_blocks(real_model_dir)
    assert quant[EMBED].bits == 8
    layer_matrices = [name for name in weights if name.startswith("model.layers.")
                      and weights[name].dim() == 2]
    assert len(layer_matrices) == 30 * 7
    assert sorted(quant) == sorted([EMBED, *layer_matrices])
    for name in layer_matrices:
        assert quant[name].bits == 4
        assert torch.equal(dequantize(quant[name]), weights[name]), name
