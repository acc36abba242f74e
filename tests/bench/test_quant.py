"""`bench quant`: both ways timed on a model that has quant blocks; none without them."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import torch

from bench.quant import load_matrices, markdown, measure, memory_read_gbps, quant_bytes
from core.config import QuantInputs


@pytest.mark.kernels
@pytest.mark.parametrize("inputs", get_args(QuantInputs))
def test_every_matrix_is_timed_both_ways(quant_model_dir: Path, inputs: QuantInputs) -> None:
    matrices = load_matrices(str(quant_model_dir), "unused", torch.float32, inputs)
    assert all(q.int8_inputs == (inputs == "int8") for m in matrices for q in m.quant)
    assert len(matrices) == 1 + 2 * 4  # the LM head, then q/k/v, o, gate/up, down per layer
    figures = measure(matrices, torch.float32, (1, 3), repeats=2)
    assert [f.rows for f in figures] == [1, 3]
    assert all(f.dense_ms > 0 and f.quant_ms > 0 for f in figures)
    size = quant_bytes(matrices)
    assert size == sum(q.packed.numel() for m in matrices for q in m.quant) > 0
    text = markdown(figures, "float32", 1, inputs, 3, size, read_gbps=12.5)
    assert f"{inputs} inputs" in text and "| 3 |" in text and "(model.quant_rows: -1): 3\n" in text
    assert text.endswith(f"quant blocks: {size / 1e6:.1f} MB; a plain read of as many bytes: "
                         "12.5 GB/s")


def test_memory_is_read_at_a_measured_rate() -> None:
    assert memory_read_gbps(64 * 2**20, repeats=2) > 0


def test_a_model_without_quant_blocks_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="no quant blocks"):
        load_matrices(str(tiny_model_dir), "unused", torch.float32)
