"""An embedding as a worker sends it: each row's float32 values, little-endian, whatever the
hidden states' dtype."""

from __future__ import annotations

import numpy as np
import torch

from engine.pooling import embedding_bytes


def test_each_row_is_its_float32_little_endian_bytes() -> None:
    hidden = torch.tensor([[1.0, -2.5, 3.25], [0.0, 1e-3, -1e3]], dtype=torch.bfloat16)
    rows = embedding_bytes(hidden)
    assert len(rows) == 2 and all(len(row) == 3 * 4 for row in rows)
    for row, expected in zip(rows, hidden.float(), strict=True):
        assert np.array_equal(np.frombuffer(row, dtype="<f4"), expected.numpy())
