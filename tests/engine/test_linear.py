"""Weight layouts: the packed bf16 product equals the plain one, and is chosen only where the
CPU has bf16 instructions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.linear import (
    PACKED,
    PLAIN,
    WeightLayout,
    can_pack_bf16,
    fast_bf16,
    layout_for,
    native_bf16,
)

needs_mkldnn_bf16 = pytest.mark.skipif(not can_pack_bf16(),
                                       reason="oneDNN has no bf16 path on this CPU")


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


def test_layout_is_packed_only_for_bf16_on_a_bf16_cpu() -> None:
    cpu = torch.device("cpu")
    assert layout_for(torch.float32, cpu) is PLAIN
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
