"""Where the files of the model a config names are: a simulated model's folder (engine.sim)
or a real one's (engine.weights). No torch here unless a real model must be prepared: the
gateway finds its tokenizer and config here too."""

from __future__ import annotations

from pathlib import Path

from core.config import sim_profile_of
from engine.sim.folder import sim_folder
from engine.weights.folder import model_folder


def resolve_model(name_or_path: str, cache_dir: str | Path) -> Path:
    """The folder of `name_or_path`: `sim` and `sim:PROFILE`, a simulated model's; anything
    else, a real model's folder, prepared first where needed (engine.weights.folder)."""
    profile = sim_profile_of(name_or_path)
    if profile is not None:
        return sim_folder(profile, cache_dir)
    return model_folder(name_or_path, cache_dir)
