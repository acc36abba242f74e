"""resolve_model: a simulated model's folder for `sim` names, a real one's for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.locate import resolve_model
from engine.sim.folder import PROFILE_FILE
from engine.weights.spec import load_spec


@pytest.mark.parametrize("name", ["sim", "sim:default"])
def test_a_sim_name_gets_a_simulated_models_folder(name: str, tmp_path: Path) -> None:
    folder = resolve_model(name, tmp_path)
    assert folder.parent == tmp_path and (folder / PROFILE_FILE).is_file()
    assert load_spec(folder).num_layers > 0


def test_any_other_name_is_a_real_models_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_model_dir), tmp_path) == tiny_model_dir
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model", tmp_path)
