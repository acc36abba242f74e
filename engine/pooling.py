"""A prompt's embedding as a worker sends it: its last token's final hidden state (the model's
last norm applied, as vLLM pools a decoder's), float32 little-endian. The gateway truncates and
normalizes it as each request asks."""

from __future__ import annotations

import torch


def embedding_bytes(hidden: torch.Tensor) -> list[bytes]:
    """Each row of `hidden` `[rows, hidden_size]` as it goes on the wire (one copy off the
    device for all of them)."""
    assert hidden.dim() == 2, "rows of hidden states"
    return [row.tobytes() for row in hidden.float().cpu().numpy().astype("<f4")]
