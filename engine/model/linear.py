"""Products with the weight matrices: oneDNN's packed path, plain `F.linear`, or over the
model's quant blocks (engine.weights.quant_blocks) at small batch sizes.

On a CPU with bf16 matrix instructions (AMX or AVX512-BF16), oneDNN reorders a bf16 weight into
its blocked layout at every call, which costs about as much as the product itself at decode
batch sizes. Packing each weight once at load time removes that: one core's decode step goes
from ~45 to ~30 ms of products, flat from batch 1 to 16, and a 256-token chunk from ~115 to
~90 ms. In fp32, oneDNN's packed products beat `F.linear` (MKL) too: on an AVX-512 EPYC,
two threads, 1.25x at 256 rows (prefill) and 1.8x at 32; capped at AVX2, 1.1x at both. The
packed copy is private to the process (the mapped file is no longer read).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from engine.kernels.isa import native_bf16
from engine.weights.quant_blocks import QuantMatrix

QUANT_ROW_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PACK_BATCH = 16  # the row count oneDNN tunes the packed layout for; larger batches still gain

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Outputs = tuple[torch.Tensor, ...]  # one per matrix of a `Matrices`


@dataclass(frozen=True)
class Matrices:
    """Weight matrices applied to the same input, one output each, two ways:

    - dense, as the layout stores them: packed, they are stacked into one matrix and
      multiplied once (q/k/v: ~30 % less time at decode batch sizes); plain, each stays a view
      of the mapped file, shared between processes;
    - over the quant blocks the model shipped in (engine.weights.quant_blocks), where every
      matrix has them: for inputs of at most `quant_rows` rows, where reading a quarter of the
      bytes beats the dense product's better arithmetic; for every input where there is no
      dense copy (`matrices` empty: engine.weights.choice).
    """

    matrices: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...]  # output features of each weight
    product: Product
    quant: tuple[QuantMatrix, ...] = ()
    quant_rows: int = 0

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.quant and (x.shape[0] <= self.quant_rows or not self.matrices):
            return self.quant_outputs(x)
        return self.dense_outputs(x)

    def dense_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.matrices) < len(self.sizes):
            return self.product(x, self.matrices[0]).split(self.sizes, dim=-1)
        return tuple(self.product(x, matrix) for matrix in self.matrices)

    def quant_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(matrix.multiply(x) for matrix in self.quant)


class Projection(Matrices):
    """Several weights of one input (q/k/v, gate/up): a tuple of outputs."""

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.outputs(x)


class Linear(Matrices):
    """One weight: one output."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.outputs(x)[0]


@dataclass(frozen=True)
class WeightLayout:
    """How weight matrices are stored (`prepare`, once at load) and multiplied (`product`)."""

    prepare: Callable[[torch.Tensor], torch.Tensor]
    product: Product
    packed: bool

    def project(self, weights: Sequence[torch.Tensor | None],
                quant: Sequence[QuantMatrix | None] = (), quant_rows: int = 0) -> Projection:
        """The products of `weights` with one input, stacked where the layout packs; over
        `quant` (each weight's quant blocks, in order) for inputs of at most `quant_rows`
        rows, and for all where `weights` are None (no dense copy)."""
        all_quant = _all_quant(quant, len(weights), quant_rows)
        return Projection(*self._matrices(weights, all_quant[0]), self.product, *all_quant)

    def linear(self, weight: torch.Tensor | None, quant: QuantMatrix | None = None,
               quant_rows: int = 0) -> Linear:
        """The product of one weight (over `quant` for at most `quant_rows` rows, or for all
        without a dense `weight`)."""
        all_quant = _all_quant((quant,), 1, quant_rows)
        return Linear(*self._matrices((weight,), all_quant[0]), self.product, *all_quant)

    def _matrices(self, weights: Sequence[torch.Tensor | None], quant: Sequence[QuantMatrix],
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        dense = [weight for weight in weights if weight is not None]
        if len(dense) < len(weights):
            assert quant, "a weight with neither a dense copy nor quant blocks"
            return (), tuple(matrix.shape[0] for matrix in quant)
        sizes = tuple(weight.shape[0] for weight in dense)
        if self.packed and len(dense) > 1:
            return (self.prepare(torch.cat(dense)),), sizes
        return tuple(self.prepare(weight) for weight in dense), sizes


def _all_quant(quant: Sequence[QuantMatrix | None], count: int,
               quant_rows: int) -> tuple[tuple[QuantMatrix, ...], int]:
    """Quant blocks only where every weight has them."""
    present = tuple(matrix for matrix in quant if matrix is not None)
    return (present, quant_rows) if len(present) == count else ((), 0)


def measure_quant_rows(weights: Sequence[Matrices], dtype: torch.dtype,
                       candidates: Sequence[int] = QUANT_ROW_CANDIDATES) -> int:
    """The most input rows (of `candidates`, in order) for which the quant products of all of
    `weights` together take less time than their dense products: 0 if none. Timed over every
    matrix (a few layers stay warm in cache and flatter the dense ones), because it depends on
    the CPU, the dtype and the dense layout (on an AVX-512 EPYC, two threads: 8-16 rows against
    packed bf16, 12-48 against packed fp32, from run to run); engine.weights.quant_rows keeps
    the result per machine."""
    timed = [matrices for matrices in weights if matrices.quant and matrices.matrices]
    if not timed:
        return 0
    best = 0
    for rows in candidates:
        inputs = [torch.randn(rows, matrices.quant[0].shape[1]).to(dtype) for matrices in timed]
        pairs = list(zip(timed, inputs, strict=True))
        dense = _best_seconds(partial(dense_products, pairs))
        quant = _best_seconds(partial(quant_products, pairs))
        if quant >= dense:
            break
        best = rows
    return best


def dense_products(pairs: Sequence[tuple[Matrices, torch.Tensor]]) -> list[Outputs]:
    """Each (matrices, input) pair's dense outputs."""
    return [matrices.dense_outputs(x) for matrices, x in pairs]


def quant_products(pairs: Sequence[tuple[Matrices, torch.Tensor]]) -> list[Outputs]:
    """Each (matrices, input) pair's outputs over the quant blocks."""
    return [matrices.quant_outputs(x) for matrices, x in pairs]


def _best_seconds(function: Callable[[], object], runs: int = 2) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH)


def _packed_product(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")


PLAIN = WeightLayout(prepare=lambda weight: weight, product=F.linear, packed=False)
PACKED = WeightLayout(prepare=_pack, product=_packed_product, packed=True)


def can_pack() -> bool:
    """Whether oneDNN is here to pack fp32 weights."""
    return torch.backends.mkldnn.is_available()


def can_pack_bf16() -> bool:
    """Whether oneDNN runs bf16 products here at all (natively or emulated)."""
    return can_pack() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def fast_bf16() -> bool:
    """Whether bf16 products here are native and can be packed: where bf16 pays."""
    return native_bf16() and can_pack_bf16()


def layout_for(dtype: torch.dtype, device: torch.device) -> WeightLayout:
    """Packed for fp32 where oneDNN is, and for bf16 on a CPU that has bf16 instructions;
    plain otherwise."""
    if device.type != "cpu":
        return PLAIN
    packs = can_pack() if dtype == torch.float32 else dtype == torch.bfloat16 and fast_bf16()
    return PACKED if packs else PLAIN
