"""model.dtype as config names it (auto resolves by what this CPU multiplies fast), and the
block row counts measured once per machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from core.config import ModelConfig, WorkerConfig
from engine.kernels import kernels
from engine.linear import fast_bf16
from engine.loading import MeasuredBlockRows, load_runner, model_dtype


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept(name: str) -> None:
    assert model_dtype(name) == name


def test_auto_is_bf16_only_where_bf16_is_fast() -> None:
    assert model_dtype("auto") == ("bfloat16" if fast_bf16() else "float32")


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="must be auto or one of"):
        model_dtype("fp8")



def test_measured_block_rows_are_kept_by_dtype_and_threads(tmp_path: Path) -> None:
    measured = MeasuredBlockRows(tmp_path)
    assert measured.get("bfloat16") is None
    measured.put("bfloat16", 32)
    measured.put("float32", 16)
    assert MeasuredBlockRows(tmp_path).get("bfloat16") == 32
    assert MeasuredBlockRows(tmp_path).get("float32") == 16
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert measured.get("bfloat16") is None  # another thread count: measured again
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_block_rows_file_is_measured_again(tmp_path: Path) -> None:
    (tmp_path / "block_rows.json").write_text("{not json")
    assert MeasuredBlockRows(tmp_path).get("bfloat16") is None
    MeasuredBlockRows(tmp_path).put("bfloat16", 8)
    assert MeasuredBlockRows(tmp_path).get("bfloat16") == 8


@pytest.mark.skipif(kernels() is None, reason="the C++ kernels did not build")
def test_a_worker_measures_once_and_later_ones_read_it(block_model_dir: Path,
                                                       tmp_path: Path) -> None:
    for path in block_model_dir.iterdir():
        (tmp_path / path.name).symlink_to(path)
    model = ModelConfig(name=str(tmp_path), dtype="float32")
    pool = WorkerConfig(num_kv_blocks=4, threads=1)
    threads = torch.get_num_threads()
    try:
        first = load_runner(model, pool).model.block_rows
        assert MeasuredBlockRows(tmp_path).get("float32") == first
        MeasuredBlockRows(tmp_path).put("float32", 3)
        assert load_runner(model, pool).model.block_rows == 3
        fixed = dataclasses.replace(model, block_rows=0)
        assert load_runner(fixed, pool).model.block_rows == 0
    finally:
        torch.set_num_threads(threads)
