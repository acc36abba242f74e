"""Finding a model's folder: a local one as given, the packaged one prepared once."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.weights.files import QUANT_FILE, READY_MARKER
from engine.weights.folder import DEFAULT_MODEL, model_folder, packaged_gguf


def test_a_local_folder_is_returned_as_given(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert model_folder(str(tiny_model_dir), tmp_path) == tiny_model_dir


def test_an_unknown_name_names_the_packaged_models(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=DEFAULT_MODEL):
        model_folder("no-such-model", tmp_path)


@pytest.mark.realmodel
def test_the_packaged_model_is_prepared_once_and_whole(real_model_dir: Path) -> None:
    assert packaged_gguf(DEFAULT_MODEL).suffix == ".gguf"
    assert (real_model_dir / READY_MARKER).exists() and (real_model_dir / QUANT_FILE).exists()
    assert model_folder(DEFAULT_MODEL, real_model_dir.parent) == real_model_dir
