"""The generation defaults a request gets for the fields it leaves out.

A request's own values always win; below them, the model folder's `generation_config.json`
(the sampling values it sets, as vLLM's `--generation-config auto` reads them), then the
config's `generation_defaults:` section.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from core.config import GenerationDefaults

log = logging.getLogger(__name__)

# generation_config.json's keys that set a default, and the field each sets (vLLM's list).
MODEL_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
              "max_new_tokens": "max_tokens"}


def resolve_defaults(configured: GenerationDefaults, model_folder: Path) -> GenerationDefaults:
    """`configured`, overridden by the model's generation_config.json where `from_model` asks
    and the file sets a value; a file whose values are unusable is ignored, with a warning."""
    if not configured.from_model:
        return configured
    found = _model_values(model_folder / "generation_config.json")
    if not found:
        return configured
    try:
        resolved = dataclasses.replace(configured, **found)
    except (TypeError, ValueError) as exc:
        log.warning("ignoring %s/generation_config.json's sampling values: %s",
                    model_folder, exc)
        return configured
    log.info("generation defaults from the model's generation_config.json: %s", found)
    return resolved


def _model_values(path: Path) -> dict[str, Any]:
    """The fields generation_config.json sets, by GenerationDefaults' names."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", path, exc)
        return {}
    if not isinstance(raw, dict):
        return {}
    found = {field: raw[key] for key, field in MODEL_KEYS.items() if raw.get(key) is not None}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if isinstance(found.get(name), int) and not isinstance(found[name], bool):
            found[name] = float(found[name])
    if not all(_typed(name, value) for name, value in found.items()):
        log.warning("ignoring %s: a sampling value has the wrong type", path)
        return {}
    return found


def _typed(name: str, value: object) -> bool:
    expected = float if name in ("temperature", "top_p", "min_p", "repetition_penalty") else int
    return isinstance(value, expected) and not isinstance(value, bool)
