"""The quant row counts measured once per machine, kept in the model folder."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.weights.files import QUANT_ROWS_FILE
from engine.weights.quant_rows import MeasuredQuantRows


def test_measured_quant_rows_are_kept_by_dtype_and_threads(tmp_path: Path) -> None:
    measured = MeasuredQuantRows(tmp_path)
    assert measured.get("bfloat16") is None
    measured.put("bfloat16", 32)
    measured.put("float32", 16)
    assert MeasuredQuantRows(tmp_path).get("bfloat16") == 32
    assert MeasuredQuantRows(tmp_path).get("float32") == 16
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert measured.get("bfloat16") is None  # another thread count: measured again
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_quant_rows_file_is_measured_again(tmp_path: Path) -> None:
    (tmp_path / QUANT_ROWS_FILE).write_text("{not json")
    assert MeasuredQuantRows(tmp_path).get("bfloat16") is None
    MeasuredQuantRows(tmp_path).put("bfloat16", 8)
    assert MeasuredQuantRows(tmp_path).get("bfloat16") == 8


def test_int8_inputs_are_measured_apart_from_exact_ones(tmp_path: Path) -> None:
    MeasuredQuantRows(tmp_path).put("float32", 16)
    int8 = MeasuredQuantRows(tmp_path, "int8")
    assert int8.get("float32") is None
    int8.put("float32", 48)
    assert MeasuredQuantRows(tmp_path).get("float32") == 16
    assert MeasuredQuantRows(tmp_path, "int8").get("float32") == 48
