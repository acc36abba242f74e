"""How the C++ kernels are built (one folder per level and digest, from copied sources), the
RMSNorm and RoPE against the torch ops they replace at every level this CPU runs, and when the
kernels apply."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import include_paths, library_paths

from engine.kernels.cpu import build
from engine.kernels.cpu.build import build_digest, chosen_isa, kernels, kernels_at, kernels_for
from engine.kernels.isa import LEVELS
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


LANES = {"generic": "scalar", "avx2": "avx2"}  # higher levels: "avx512"


def test_each_level_builds_with_its_own_vectors(every_isa: str) -> None:
    module = kernels()
    assert module is not None
    assert module.lanes == LANES.get(every_isa, "avx512")
    assert module.__name__ == f"raging_kernels_{every_isa}"


def test_a_build_is_made_from_sources_in_its_own_folder(cpu_kernels: ModuleType) -> None:
    """ninja's commands name the sources: copied into the build folder, their paths are the
    same from every checkout, so checkouts do not rebuild over each other."""
    assert cpu_kernels.__file__ is not None
    folder = Path(cpu_kernels.__file__).parent
    level = chosen_isa()
    assert folder.name.startswith(f"raging_kernels-{level.name}-")
    ninja = (folder / "build.ninja").read_text()
    assert f"{folder}/src/quant_linear.cpp" in ninja
    assert "engine/kernels/cpu/csrc" not in ninja
    assert kernels_at(level)[0] is cpu_kernels


def test_the_build_digest_changes_with_the_flags() -> None:
    digests = {build_digest(list(level.cflags)) for level in LEVELS}
    assert len(digests) == len(LEVELS)
    assert build_digest(["-mavx2"]) == build_digest(["-mavx2"])


def test_the_build_digest_covers_every_path_the_build_names(
        cpu_kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two virtual environments' torch lie in different folders, which a build's commands
    name: sharing one build folder, each would rebuild over the other (~30 s a start)."""
    assert cpu_kernels.__file__ is not None
    ninja = (Path(cpu_kernels.__file__).parent / "build.ninja").read_text()
    named = re.findall(r"-isystem (\S+)", ninja) + re.findall(r" -L(\S+)", ninja)
    assert sorted(named) == sorted([*include_paths(), *library_paths(),
                                    sysconfig.get_paths()["include"]])
    here = build_digest(["-mavx2"])
    monkeypatch.setattr(build, "include_paths", lambda: ["/other/.venv/torch/include"])
    assert build_digest(["-mavx2"]) != here


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_matches_torch(every_isa: str, dtype: torch.dtype, rows: int) -> None:
    cpu_kernels = kernels()
    assert cpu_kernels is not None
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
def test_rope_matches_torch_on_a_slice_of_the_qkv_output(every_isa: str, dtype: torch.dtype,
                                                         tokens: int) -> None:
    cpu_kernels = kernels()
    assert cpu_kernels is not None
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (9 + 3 + 3) * 64).to(dtype)
    k = qkv[:, 9 * 64:12 * 64].view(tokens, 3, 64)  # strided tokens, as the model passes it
    angles = torch.rand(tokens, 1, 64) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out = cpu_kernels.rope(k, cos, sin)
    assert out.dtype == dtype and out.shape == k.shape and out.is_contiguous()
    expected = rotate(k.float(), cos.float(), sin.float())
    assert_near(out, expected, dtype)
