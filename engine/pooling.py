"""A prompt's embedding as a worker sends it: its last token's final hidden state (the model's
last norm applied, as vLLM pools a decoder's), float32 little-endian. The gateway truncates and
normalizes it as each request asks."""

from __future__ import annotations

import torch


def embedding_bytes(hidden: torch.Tensor) -> bytes:
    """One hidden state `[hidden_size]` on the wire."""
    assert hidden.dim() == 1, "one row"
    return hidden.float().cpu().numpy().astype("<f4").tobytes()
