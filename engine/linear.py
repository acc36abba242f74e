"""Products with the weight matrices: plain `F.linear`, or oneDNN's packed bf16 path.

On a CPU with bf16 matrix instructions (AMX or AVX512-BF16), oneDNN reorders a bf16 weight into
its blocked layout at every call, which costs about as much as the product itself at decode
batch sizes. Packing each weight once at load time removes that: one core's decode step goes
from ~45 to ~30 ms of products, flat from batch 1 to 16, and a 256-token chunk from ~115 to
~90 ms. The packed copy is private to the process (the mapped file is no longer read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

PACK_BATCH = 16  # the row count oneDNN tunes the packed layout for; larger batches still gain
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@cache
def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (else bf16 is emulated, and slow)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return not BF16_FLAGS.isdisjoint(flags)


@dataclass(frozen=True)
class Projection:
    """Weight matrices applied to the same input, one output each. Packed, they are stacked
    into one matrix and multiplied once (q/k/v: ~30 % less time at decode batch sizes); plain,
    each stays a view of the mapped file, shared between processes."""

    matrices: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...]  # output features of each weight
    product: Product

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.matrices) < len(self.sizes):
            return self.product(x, self.matrices[0]).split(self.sizes, dim=-1)
        return tuple(self.product(x, matrix) for matrix in self.matrices)


@dataclass(frozen=True)
class WeightLayout:
    """How weight matrices are stored (`prepare`, once at load) and multiplied (`product`)."""

    prepare: Callable[[torch.Tensor], torch.Tensor]
    product: Product
    packed: bool

    def project(self, weights: Sequence[torch.Tensor]) -> Projection:
        """The products of `weights` with one input, stacked where the layout packs."""
        sizes = tuple(weight.shape[0] for weight in weights)
        if self.packed and len(weights) > 1:
            return Projection((self.prepare(torch.cat(tuple(weights))),), sizes, self.product)
        return Projection(tuple(self.prepare(weight) for weight in weights), sizes, self.product)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH)


def _packed_product(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


PLAIN = WeightLayout(prepare=lambda weight: weight, product=F.linear, packed=False)
PACKED = WeightLayout(prepare=_pack, product=_packed_product, packed=True)


def can_pack_bf16() -> bool:
    """Whether oneDNN runs bf16 products here at all (natively or emulated)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def fast_bf16() -> bool:
    """Whether bf16 products here are native and can be packed: where bf16 pays."""
    return native_bf16() and can_pack_bf16()


def layout_for(dtype: torch.dtype, device: torch.device) -> WeightLayout:
    """Packed for bf16 on a CPU that has bf16 instructions, plain otherwise."""
    if dtype == torch.bfloat16 and device.type == "cpu" and fast_bf16():
        return PACKED
    return PLAIN
