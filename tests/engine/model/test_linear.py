"""Weight layouts: the packed products equal the plain ones, and are chosen for fp32 where
oneDNN is and for bf16 only where the CPU has bf16 instructions."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.isa import native_bf16
from engine.model.linear import (
    PACKED,
    PLAIN,
    WeightLayout,
    can_pack,
    can_pack_bf16,
    fast_bf16,
    layout_for,
    measure_quant_rows,
)
from engine.weights.quant_blocks import QuantMatrix, dequantize, quantize

needs_mkldnn = pytest.mark.skipif(not can_pack(), reason="this torch has no oneDNN")
needs_mkldnn_bf16 = pytest.mark.skipif(not can_pack_bf16(),
                                       reason="oneDNN has no bf16 path on this CPU")
needs_kernels = pytest.mark.kernels


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu sse avx512f amx_bf16 amx_tile", True),
    ("fpu sse avx512f avx512_bf16", True),
    ("fpu sse avx2 fma", False),
])
def test_native_bf16_reads_the_cpu_flags(tmp_path: Path, flags: str, expected: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n")
    assert native_bf16(cpuinfo) is expected


def test_no_cpuinfo_means_no_native_bf16(tmp_path: Path) -> None:
    assert native_bf16(tmp_path / "missing") is False


def test_layout_is_packed_for_fp32_and_for_bf16_on_a_bf16_cpu() -> None:
    cpu = torch.device("cpu")
    assert layout_for(torch.float32, cpu) is (PACKED if can_pack() else PLAIN)
    assert layout_for(torch.float16, cpu) is PLAIN
    expected = PACKED if fast_bf16() else PLAIN
    assert layout_for(torch.bfloat16, cpu) is expected


@needs_mkldnn_bf16
@pytest.mark.parametrize("rows", [1, 5, 16, 40, 300])
def test_packed_product_equals_plain(rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    packed = PACKED.product(x, PACKED.prepare(weight))
    assert packed.shape == (rows, 96) and packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed, F.linear(x, weight), atol=2e-2, rtol=2e-2)


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 5, 16, 40, 300])
def test_packed_fp32_product_equals_plain(rows: int) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 64), torch.randn(rows, 64)
    packed = PACKED.product(x, PACKED.prepare(weight))
    assert packed.shape == (rows, 96) and packed.dtype == torch.float32
    torch.testing.assert_close(packed, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_plain_layout_keeps_the_weight_itself() -> None:
    weight = torch.randn(8, 4)
    assert PLAIN.prepare(weight) is weight


@pytest.mark.parametrize("layout", [
    PLAIN, pytest.param(PACKED, marks=needs_mkldnn_bf16),
], ids=["plain", "packed"])
def test_projection_gives_each_weights_product(layout: WeightLayout) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(rows, 64).to(torch.bfloat16) for rows in (96, 32, 32)]
    x = torch.randn(5, 64).to(torch.bfloat16)
    projection = layout.project(weights)
    # Packed weights are stacked and multiplied once; plain ones stay the file's own tensors.
    assert len(projection.matrices) == (1 if layout.packed else 3)
    if not layout.packed:
        assert all(m is w for m, w in zip(projection.matrices, weights, strict=True))
    outputs = projection(x)
    assert [out.shape for out in outputs] == [(5, 96), (5, 32), (5, 32)]
    for out, weight in zip(outputs, weights, strict=True):
        torch.testing.assert_close(out, F.linear(x, weight), atol=2e-2, rtol=2e-2)


def quantized(rows: int, columns: int, seed: int) -> tuple[torch.Tensor, QuantMatrix]:
    """A weight exactly held by 4-bit quant blocks, and those."""
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))
    quant = quantize(weight, 4)
    return dequantize(quant), quant


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_small_inputs_go_over_the_quant_blocks_and_larger_ones_dense(rows: int) -> None:
    pairs = [quantized(n, 64, seed=n) for n in (96, 32)]
    weights, quant = [w for w, _ in pairs], [q for _, q in pairs]
    projection = PLAIN.project(weights, quant, quant_rows=4)
    linear = PLAIN.linear(weights[0], quant[0], quant_rows=4)
    x = torch.randn(rows, 64)
    expected = projection.quant_outputs(x) if rows <= 4 else projection.dense_outputs(x)
    for out, want in zip(projection(x), expected, strict=True):
        assert torch.equal(out, want)
    assert torch.equal(linear(x), expected[0])
    for out, weight in zip(projection(x), weights, strict=True):
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_quant_blocks_serve_only_where_every_weight_has_them() -> None:
    (weight, quant), (other, _) = quantized(32, 64, seed=1), quantized(32, 64, seed=2)
    projection = PLAIN.project([weight, other], [quant, None], quant_rows=8)
    assert projection.quant == () and projection.quant_rows == 0


def slow(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def slowed(*args: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return function(*args)
    return slowed


@needs_kernels
def test_quant_rows_measured_are_those_where_quant_products_are_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight, quant = quantized(64, 64, seed=3)
    candidates = (1, 2, 4)
    slow_dense = WeightLayout(PLAIN.prepare, slow(F.linear), packed=False)
    assert measure_quant_rows([slow_dense.linear(weight, quant)], torch.float32,
                              candidates) == 4
    monkeypatch.setattr(QuantMatrix, "multiply", slow(QuantMatrix.multiply))
    assert measure_quant_rows([PLAIN.linear(weight, quant)], torch.float32, candidates) == 0
    assert measure_quant_rows([PLAIN.linear(weight)], torch.float32, candidates) == 0
