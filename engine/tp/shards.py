"""A rank's share of a model: its slice of the spec and of the weights (engine.tp)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.weights.quant_blocks import QUANT_BLOCK, QUANT_BLOCK_BYTES, QuantMatrix
from engine.weights.spec import ModelSpec


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: its query heads, KV heads and MLP columns."""

    rank: int
    size: int
    spec: ModelSpec  # the whole model's

    def __post_init__(self) -> None:
        spec = self.spec
        for what, count in (("attention heads", spec.num_heads),
                            ("KV heads", spec.num_kv_heads),
                            ("MLP columns", spec.intermediate_size)):
            if count % self.size:
                raise ValueError(f"model.tp={self.size} does not divide the model's {count} "
                                 f"{what}")
        assert 0 <= self.rank < self.size

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The KV heads this rank holds, begin and end."""
        share = self.spec.num_kv_heads // self.size
        return self.rank * share, (self.rank + 1) * share

    def local_spec(self) -> ModelSpec:
        """The spec of this rank's share: its heads and MLP columns."""
        spec = self.spec
        return replace(spec, num_heads=spec.num_heads // self.size,
                       num_kv_heads=spec.num_kv_heads // self.size,
                       intermediate_size=spec.intermediate_size // self.size)

    def weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of the dense `weights` (views; whole where every rank needs
        them)."""
        return {name: self._slice(name, tensor) for name, tensor in weights.items()}

    def quant(self, quant: dict[str, QuantMatrix]) -> dict[str, QuantMatrix] | None:
        """This rank's slices of the weights' quant blocks: rows split are views (shared by
        every process mapping the file), columns split are copies of this rank's quant blocks
        (the products read whole rows). None where a rank's columns do not split into whole
        quant blocks."""
        if any(columns // self.size % QUANT_BLOCK for columns in self._split()[1].values()):
            return None
        return {name: self._slice_quant(name, matrix) for name, matrix in quant.items()}

    def _split(self) -> tuple[dict[str, int], dict[str, int]]:
        """By the name of a layer's matrix, the size split: its rows; its columns."""
        spec = self.spec
        rows = {"q_proj": spec.num_heads * spec.head_dim,
                "k_proj": spec.num_kv_heads * spec.head_dim,
                "v_proj": spec.num_kv_heads * spec.head_dim,
                "gate_proj": spec.intermediate_size, "up_proj": spec.intermediate_size}
        columns = {"o_proj": spec.num_heads * spec.head_dim, "down_proj": spec.intermediate_size}
        return rows, columns

    def _slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        rows, columns = self._split()
        part = _part(name)
        if part in rows:
            return self._share(tensor, 0, rows[part])
        if part in columns:
            return self._share(tensor, 1, columns[part])
        return tensor

    def _slice_quant(self, name: str, matrix: QuantMatrix) -> QuantMatrix:
        rows, columns = self._split()
        part = _part(name)
        if part in rows:
            return replace(matrix, packed=self._share(matrix.packed, 0, rows[part]))
        if part in columns:
            per_block = QUANT_BLOCK_BYTES[matrix.bits]
            total = columns[part] // QUANT_BLOCK * per_block
            packed = self._share(matrix.packed, 1, total).contiguous()
            return replace(matrix, packed=packed)
        return matrix

    def _share(self, tensor: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        if tensor.shape[dim] != total:  # the weights file disagrees with the model's config
            raise ValueError(f"a weight of shape {tuple(tensor.shape)} has {tensor.shape[dim]} "
                             f"along dimension {dim}, where the config gives {total}")
        share = total // self.size
        return tensor.narrow(dim, self.rank * share, share)


def _part(name: str) -> str:
    """q_proj, down_proj...: which of a layer's matrices `name` is ("" for others)."""
    return name.split(".")[-2] if name.startswith("model.layers.") else ""
