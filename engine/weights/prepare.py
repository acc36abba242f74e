"""Prepare the packaged default model's folder once: dequantize its GGUF into safetensors +
tokenizer + config, and keep the weights' quant blocks (engine.weights.folder finds the folder and
calls this when it is missing)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.weights.files import READY_MARKER, WEIGHTS_FILE
from engine.weights.quant_blocks import write_quant_blocks


def prepare(gguf_path: Path, target: Path) -> None:
    """Dequantize `gguf_path` into `target` (fp32 safetensors, tokenizer, config), and keep
    the quant blocks of the weights (engine.weights.quant_blocks) for small-batch products."""
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
    steps.set_postfix_str("finding the quant blocks")
    write_quant_blocks(staging)
    (staging / READY_MARKER).write_text(f"prepared in {time.monotonic() - start:.1f}s\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    steps.update()
    steps.close()


def save_weights(model: PreTrainedModel, folder: Path) -> None:
    """Write plain safetensors + config.json (save_pretrained refuses GGUF-loaded models)."""
    folder.mkdir(parents=True)
    config = model.config
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
