"""A model folder's record of what `python -m engine` prepared it for, and the start it spares."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from core.config import Config, DecodeConfig, ModelConfig, PrefillConfig
from engine.prepared import is_prepared, record_prepared, thread_counts
from engine.weights.files import PREPARED_FILE

ROOT = Path(__file__).resolve().parents[2]


def config_for(folder: Path, **model: object) -> Config:
    return Config(model=ModelConfig(name=str(folder), **model),  # type: ignore[arg-type]
                  prefill=PrefillConfig(threads=1), decode=DecodeConfig(threads=2))


def test_preparation_measures_each_thread_count_a_worker_may_run_with() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert thread_counts(Config(prefill=PrefillConfig(threads=3),
                                decode=DecodeConfig(threads=3))) == (3,)
    assert thread_counts(Config(prefill=PrefillConfig(threads=2),
                                decode=DecodeConfig(threads=0))) == tuple(sorted({1, 2, cpus}))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    return tmp_path


def test_a_recorded_config_is_prepared_and_another_is_not(folder: Path) -> None:
    config = config_for(folder)
    assert not is_prepared(config, folder)
    record_prepared(config, folder, None)
    assert is_prepared(config, folder)
    assert not is_prepared(config_for(folder, dtype="bfloat16"), folder)
    assert not is_prepared(dataclasses.replace(config, decode=DecodeConfig(threads=3)), folder)
    assert not is_prepared(dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, isa="generic")), folder)


def test_a_file_of_the_folder_changed_since_undoes_the_record(folder: Path) -> None:
    config = config_for(folder)
    record_prepared(config, folder, None)
    (folder / "quant_rows.json").write_text("{}")  # measured rows lost or rewritten
    assert not is_prepared(config, folder)
    record_prepared(config, folder, None)
    assert is_prepared(config, folder)
    os.utime(folder / "model.safetensors", ns=(1, 1))
    assert not is_prepared(config, folder)


def test_kernels_gone_since_undo_the_record(folder: Path, tmp_path_factory: pytest.TempPathFactory
                                            ) -> None:
    config = config_for(folder)
    library = tmp_path_factory.mktemp("build") / "raging_kernels_avx2.so"
    library.write_bytes(b"elf")
    record_prepared(config, folder, library)
    assert is_prepared(config, folder)
    library.unlink()
    assert not is_prepared(config, folder)


def test_a_damaged_record_prepares_again_and_the_record_stays_bounded(folder: Path) -> None:
    config = config_for(folder)
    (folder / PREPARED_FILE).write_text("{not json")
    assert not is_prepared(config, folder)
    for threads in range(1, 80):
        record_prepared(dataclasses.replace(config, decode=DecodeConfig(threads=threads)),
                        folder, None)
    assert len(json.loads((folder / PREPARED_FILE).read_text())) == 64
    assert is_prepared(dataclasses.replace(config, decode=DecodeConfig(threads=79)), folder)
    assert not is_prepared(dataclasses.replace(config, decode=DecodeConfig(threads=1)), folder)


def test_a_record_that_cannot_be_written_is_left_out(folder: Path) -> None:
    config = config_for(folder)
    (folder / PREPARED_FILE).mkdir()  # in its place, what no file can be renamed over
    record_prepared(config, folder, None)
    assert not is_prepared(config, folder)
    assert [path.name for path in folder.iterdir() if path.name.endswith(".partial")] == []


def test_files_half_written_beside_the_record_change_nothing(folder: Path) -> None:
    config = config_for(folder)
    record_prepared(config, folder, None)
    (folder / "quant_rows.json.123.partial").write_text("{")  # another process writing
    assert is_prepared(config, folder)


def test_a_second_start_answers_without_torch(make_tiny_model: Callable[..., Path],
                                              tmp_path: Path) -> None:
    """`python -m engine` prepares a folder once; the next run, as launch.sh makes before each
    start, prints the folder without importing torch."""
    tiny_model_dir = make_tiny_model()
    config = tmp_path / "config.yaml"
    config.write_text("prefill: {threads: 1}\ndecode: {threads: 1}\n")
    run = [sys.executable, "-c", "import runpy, sys; runpy.run_module('engine', "
           "run_name='__main__'); print('torch' in sys.modules)",
           "--config", str(config), "--model", str(tiny_model_dir)]
    first = subprocess.run(run, capture_output=True, text=True, check=True, cwd=ROOT)
    assert first.stdout.split() == [str(tiny_model_dir), "True"]
    second = subprocess.run(run, capture_output=True, text=True, check=True, cwd=ROOT)
    assert second.stdout.split() == [str(tiny_model_dir), "False"]
    config.write_text("prefill: {threads: 1}\ndecode: {threads: 2}\n")  # not yet measured
    third = subprocess.run(run, capture_output=True, text=True, check=True, cwd=ROOT)
    assert third.stdout.split() == [str(tiny_model_dir), "True"]
