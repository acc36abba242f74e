"""The C++ RMSNorm and RoPE against the torch ops they replace, and when the kernels apply."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.build import kernels, kernels_for
from engine.model.rope import rotate

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def assert_near(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to rounding; bf16 within one step of its 8-bit mantissa (one rounding less)."""
    fp32 = dtype == torch.float32
    torch.testing.assert_close(out.float(), expected, atol=1e-5 if fp32 else 2e-2,
                               rtol=1e-5 if fp32 else 8e-3)


def test_kernels_apply_only_to_fp32_or_bf16_alike() -> None:
    fp32, bf16 = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    assert kernels_for(torch.zeros(2, dtype=torch.float16)) is None
    assert kernels_for(fp32, bf16) is None
    assert kernels_for(fp32, fp32) is kernels()
    assert kernels_for(bf16, bf16) is kernels()


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_matches_torch(cpu_kernels: ModuleType, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    wide = (torch.randn(rows, 2 * 576) * 3).to(dtype)
    x = wide[:, 100:676]  # rows strided, as a slice of a wider output
    weight = torch.randn(576).to(dtype)
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.is_contiguous()
    expected = F.rms_norm(x.float(), (576,), weight.float(), eps=1e-5)
    assert_near(out, expected, dtype)


@DTYPES
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rope_matches_torch_on_a_slice_of_the_qkv_output(cpu_kernels: ModuleType,
                                                         dtype: torch.dtype, tokens: int) -> None:
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (9 + 3 + 3) * 64).to(dtype)
    k = qkv[:, 9 * 64:12 * 64].view(tokens, 3, 64)  # strided tokens, as the model passes it
    angles = torch.rand(tokens, 1, 64) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = cpu_kernels.rope(k, cos, sin)
    assert out.dtype == dtype and out.shape == k.shape and out.is_contiguous()
    expected = rotate(k.float(), cos.float(), sin.float())
    assert_near(out, expected, dtype)
