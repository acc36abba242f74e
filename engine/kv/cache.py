"""The paged KV cache: per-layer K and V tensors addressed by block tables."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from engine.kv import huge_pages
from engine.weights.spec import ModelSpec


def slot_mapping(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token `positions` ([..., T]) under block `tables` ([..., num_blocks])."""
    blocks = torch.gather(tables, -1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


class PagedKVCache:
    """K and V of every layer, each `[num_blocks * block_size, num_kv_heads, head_dim]`.

    Token position p of a sequence with block table t lives in slot
    `t[p // block_size] * block_size + p % block_size`. With `pad_block`, one block more than
    `num_blocks` is kept at index `num_blocks`, never handed out: where the padding rows of a
    fixed-shape step (a CUDA graph's) write and read.
    """

    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device | str = "cpu", pad_block: bool = False,
        shared_file: Path | None = None,
    ) -> None:
        """`shared_file`: K and V live in this file (zeroed, of `shared_bytes`), mapped shared:
        the processes of one tensor-parallel worker all map it (engine.tp)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"bad num_blocks={num_blocks} / block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.num_layers = spec.num_layers
        self.pad_block = num_blocks if pad_block else None
        rows = (num_blocks + pad_block) * block_size
        shape = (spec.num_layers, rows, spec.num_kv_heads, spec.head_dim)
        # One tensor per kind, so reads and writes of all layers are one indexing op each.
        if shared_file is not None:
            both = torch.from_file(str(shared_file), shared=True, size=2 * math.prod(shape),
                                   dtype=dtype)
            self.k, self.v = (half.view(shape) for half in both.chunk(2))
        else:
            self.k, self.v = (huge_pages.zeros(shape, dtype) if torch.device(device).type == "cpu"
                              else torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        self.device = self.k.device
        self.bytes_per_token = spec.kv_bytes_per_token(dtype)

    @staticmethod
    def shared_bytes(spec: ModelSpec, num_blocks: int, block_size: int,
                     dtype: torch.dtype) -> int:
        """The size of a `shared_file` for these settings (no pad block)."""
        return num_blocks * block_size * spec.kv_bytes_per_token(dtype)

    def head_slice(self, begin: int, end: int) -> PagedKVCache:
        """The same cache seen through KV heads begin..end-1 only (views: writes land here)."""
        view = copy.copy(self)
        view.k, view.v = self.k[:, :, begin:end], self.v[:, :, begin:end]
        return view

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions start..end-1."""
        if not 0 <= start <= end <= len(block_table) * self.block_size:
            capacity = len(block_table) * self.block_size
            raise ValueError(f"positions {start}..{end} do not fit a table of {capacity} slots")
        table = torch.tensor(block_table, dtype=torch.long)
        slots = slot_mapping(table, torch.arange(start, end), self.block_size)
        return slots.to(self.device, non_blocking=True)

    def copy_block(self, source: int, target: int) -> None:
        """Copy every layer's K and V of block `source` into block `target` (copy-on-write)."""
        size = self.block_size
        for cache in (self.k, self.v):
            cache[:, target * size:(target + 1) * size] = cache[:, source * size:
                                                                (source + 1) * size]

    def read(self, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `num_tokens` tokens, each `[num_layers, num_tokens, H, D]`."""
        slots = self.slots(block_table, 0, num_tokens)
        return self.k.index_select(1, slots), self.v.index_select(1, slots)

    def read_layers(
        self, start: int, end: int, block_table: list[int], num_tokens: int,
        token_start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layers start..end-1 for token positions token_start..num_tokens-1, each
        `[end - start, num_tokens - token_start, H, D]`."""
        assert 0 <= start < end <= self.num_layers
        slots = self.slots(block_table, token_start, num_tokens)
        return self.k[start:end].index_select(1, slots), self.v[start:end].index_select(1, slots)

    def write(self, block_table: list[int], start: int, k: torch.Tensor, v: torch.Tensor,
              layer_start: int = 0) -> None:
        """Store `[layers, T, H, D]` K and V of layers layer_start.. at token positions
        start..start+T-1."""
        layers = k.shape[0] if k.dim() == 4 else -1
        if not 0 <= layer_start <= layer_start + layers <= self.num_layers:
            raise ValueError(f"layers {layer_start}..{layer_start + layers} are not in the cache")
        num_tokens = self._check_incoming(k, v, (layers,))
        slots = self.slots(block_table, start, start + num_tokens)
        k, v = self._here(k), self._here(v)
        self.k[layer_start:layer_start + layers].index_copy_(1, slots, k)
        self.v[layer_start:layer_start + layers].index_copy_(1, slots, v)

    def write_layer(
        self, layer: int, block_table: list[int], start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store one layer's `[T, H, D]` K and V at token positions start..start+T-1."""
        num_tokens = self._check_incoming(k, v, ())
        self.store(layer, self.slots(block_table, start, start + num_tokens), k, v)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's `[T, H, D]` K and V at the given flat slots (on the cache's
        device)."""
        self.k[layer].index_copy_(0, slots, self._here(k))
        self.v[layer].index_copy_(0, slots, self._here(v))

    def _here(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the cache's device (KV received from another device or the host)."""
        return tensor.to(self.device, non_blocking=True)

    def _check_incoming(self, k: torch.Tensor, v: torch.Tensor, layers: tuple[int, ...]) -> int:
        """The number of tokens in K and V, after checking their shapes and dtypes."""
        num_tokens = k.shape[-3] if k.dim() >= 3 else -1
        shape = (*layers, num_tokens, *self.k.shape[2:])
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise ValueError(f"expected K and V of shape {shape}, got {k.shape}, {v.shape}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"expected {self.dtype}, got {k.dtype}, {v.dtype}")
        return num_tokens
