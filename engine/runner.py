"""A loaded model with its paged KV cache and block allocator, ready to run batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.batch import ForwardBatch
from engine.block_allocator import BlockAllocator
from engine.blocks import load_blocks
from engine.kv_cache import PagedKVCache
from engine.model import LlamaModel
from engine.spec import load_spec
from engine.weights import load_weights


def set_threads(n: int | None) -> None:
    """Use `n` intra-op CPU threads; None keeps torch's default."""
    if n is None:
        return
    if n <= 0:
        raise ValueError(f"thread count must be positive, got {n}")
    torch.set_num_threads(n)


class ModelRunner:
    """Owns the model, a `num_blocks` x `block_size` KV cache and the allocator of its blocks."""

    def __init__(
        self,
        model_dir: Path,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        block_rows: int | None = None,
    ) -> None:
        """`block_rows`: products of at most this many rows read the model's quantized blocks
        where it has them (engine.blocks); None: measured here at load, 0: never."""
        self.model_dir = Path(model_dir)
        self.spec = load_spec(self.model_dir)
        self.block_size = block_size
        self.model = LlamaModel(self.spec, load_weights(self.model_dir, dtype),
                                blocks=load_blocks(self.model_dir), block_rows=block_rows)
        self.cache = PagedKVCache(self.spec, num_blocks, block_size, dtype)
        self.allocator = BlockAllocator(num_blocks)

    def forward(
        self, batch: ForwardBatch, layer_hook: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """fp32 logits `[num_seqs, vocab]` of each sequence's last new token (see LlamaModel)."""
        return self.model.forward(batch, self.cache, layer_hook)
