"""Weight matrices as the quant blocks a GGUF file ships them in: llama.cpp's Q4_1, Q8_0.

("Quant block" here, so that a plain "block" always means a KV cache block.) Each row of a
matrix is cut into quant blocks of 32 values. Q4_1 stores one as fp16 `d` and `m` and 32 4-bit
`q` (value `d * q + m`) in 20 bytes; Q8_0 as fp16 `d` and 32 signed bytes (value `d * q`) in 34.
Both values are exact in fp32, so a product over the quant blocks multiplies the very weights
transformers dequantizes from the file, reading a quarter (or half) of the bf16 bytes.

`exact_quant` finds the format that reproduces a dequantized matrix bit for bit. It does for a
GGUF's Q4_1 and Q8_0 tensors: llama.cpp's quantizer gives every quant block a q of 0 and of 15
(or of ±127), so d and m are recovered from its smallest and largest values. A matrix that no
format reproduces (weights that never were quantized) has none and is used dense.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.kernels.cpu.build import kernels_for
from engine.weights.files import EMBED, LM_HEAD, QUANT_FILE
from engine.weights.load import load_weights

QUANT_BLOCK = 32  # values per quant block
QUANT_BLOCK_BYTES = {4: 20, 8: 34}  # by bits per value: Q4_1, Q8_0


@dataclass(frozen=True)
class QuantMatrix:
    """A `[rows, columns]` weight as uint8 `[rows, columns // 32 * bytes per quant block]`;
    `int8_inputs`: its products quantize their inputs to 8-bit blocks too (`model.quant_inputs:
    int8`, llama.cpp's integer products) instead of multiplying them as they are."""

    packed: torch.Tensor
    bits: int
    int8_inputs: bool = False

    def __post_init__(self) -> None:
        assert self.bits in QUANT_BLOCK_BYTES, f"no {self.bits}-bit quant format"
        assert self.packed.dtype == torch.uint8 and self.packed.dim() == 2
        assert self.packed.shape[1] % QUANT_BLOCK_BYTES[self.bits] == 0

    @property
    def shape(self) -> tuple[int, int]:
        per_row = self.packed.shape[1] // QUANT_BLOCK_BYTES[self.bits]
        return self.packed.shape[0], per_row * QUANT_BLOCK

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T for fp32 or bf16 `x` `[rows, columns]`, in x's dtype (C++ kernels:
        engine/kernels/cpu/csrc/quant_linear.cpp, quant_int8.cpp; the caller checks
        `kernels_for(x)` first)."""
        module = kernels_for(x)
        assert module is not None, "quant products need the C++ kernels"
        if self.int8_inputs:
            return module.quant_linear_int8(x, self.packed, self.bits)
        return module.quant_linear(x, self.packed, self.bits)


def quantize(weight: torch.Tensor, bits: int) -> QuantMatrix:
    """`weight` `[rows, columns]` (columns a multiple of 32) in `bits`-bit quant blocks,
    rounded as llama.cpp rounds."""
    rows, columns = weight.shape
    assert columns % QUANT_BLOCK == 0, f"{columns} columns do not split by {QUANT_BLOCK}"
    values = weight.float().reshape(rows, columns // QUANT_BLOCK, QUANT_BLOCK)
    parts = _quantize_q4_1(values) if bits == 4 else _quantize_q8_0(values)
    packed = torch.cat([part.view(torch.uint8) for part in parts], dim=-1)
    return QuantMatrix(packed.reshape(rows, -1), bits)


def _quantize_q4_1(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    low, high = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half(), low.half()
    q = _divide_rounded(values - m.float(), d.float()).clamp(0, 15).to(torch.uint8)
    return d, m, q[..., :16] | (q[..., 16:] << 4)


def _quantize_q8_0(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = (values.abs().amax(-1, keepdim=True) / 127).half()
    return d, _divide_rounded(values, d.float()).clamp(-127, 127).to(torch.int8)


def _divide_rounded(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values / scale rounded, 0 where a quant block's scale is 0 (its values all equal)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, (values / safe).round(), torch.zeros_like(values))


def dequantize(matrix: QuantMatrix) -> torch.Tensor:
    """The fp32 `[rows, columns]` weight the quant blocks hold."""
    rows, columns = matrix.shape
    packed = matrix.packed.reshape(rows, columns // QUANT_BLOCK, QUANT_BLOCK_BYTES[matrix.bits])
    d = packed[..., 0:2].contiguous().view(torch.float16).float()
    if matrix.bits == 4:
        m = packed[..., 2:4].contiguous().view(torch.float16).float()
        q = torch.cat([packed[..., 4:] & 0xF, packed[..., 4:] >> 4], dim=-1).float()
        return (q * d + m).reshape(rows, columns)
    q = packed[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(rows, columns)


def exact_quant(weight: torch.Tensor) -> QuantMatrix | None:
    """The fewest-bits quant blocks that hold `weight` bit for bit, or None."""
    if weight.dim() != 2 or weight.shape[1] % QUANT_BLOCK or weight.dtype != torch.float32:
        return None
    for bits in sorted(QUANT_BLOCK_BYTES):
        matrix = quantize(weight, bits)
        if torch.equal(dequantize(matrix), weight):
            return matrix
    return None


def write_quant_blocks(folder: Path) -> int:
    """Write the exact quant blocks of every weight of `folder` that has them to its quant
    file (atomically, so workers starting together never read half a file); returns how
    many."""
    weights = load_weights(folder, torch.float32)
    if weights[LM_HEAD] is weights[EMBED]:  # tied: one tensor under two names
        del weights[LM_HEAD]
    found = {name: matrix for name, weight in weights.items()
             if (matrix := exact_quant(weight)) is not None}
    path = Path(folder) / QUANT_FILE
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    bits = {name: str(matrix.bits) for name, matrix in found.items()}
    # safetensors writes an unreadable file for no tensors and no metadata: there is always one
    save_file({name: matrix.packed for name, matrix in found.items()}, partial,
              metadata={"format": "pt", **bits})
    partial.rename(path)
    return len(found)


def load_quant_blocks(folder: Path, int8_inputs: bool = False) -> dict[str, QuantMatrix]:
    """The quant blocks in the folder's quant file by weight name, memory-mapped (so every
    worker on a host shares one copy); none if the file is absent. `int8_inputs`: see
    `QuantMatrix`."""
    path = Path(folder) / QUANT_FILE
    if not path.exists():
        return {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        bits = f.metadata() or {}
        return {name: QuantMatrix(f.get_tensor(name), int(bits[name]), int8_inputs)
                for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
