"""Qwen2 (biases on q, k and v; untied embeddings) through our forward pass, against
transformers' Qwen2ForCausalLM on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from engine.kv.cache import PagedKVCache
from engine.model.batch import ForwardBatch
from engine.model.llama import LlamaModel
from engine.runner import ModelRunner
from engine.weights.load import load_weights
from engine.weights.spec import load_spec
from tests.engine.model.test_llama import BLOCK_SIZE, TOLERANCE, random_prompt


def test_logits_match_transformers_prefill_and_decode(tiny_qwen2_dir: Path) -> None:
    spec = load_spec(tiny_qwen2_dir)
    assert spec.qkv_bias and not spec.tie_word_embeddings
    model = LlamaModel(spec, load_weights(tiny_qwen2_dir, torch.float32))
    cache = PagedKVCache(spec, 64, BLOCK_SIZE, torch.float32)
    reference = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    prompts = [random_prompt(n, seed=n) for n in (5, 17)]
    tables = [list(range(0, 10)), list(range(10, 20))]
    logits = model.forward(ForwardBatch(prompts, [0, 0], tables), cache)
    for _ in range(6):
        with torch.inference_mode():
            for row, prompt in enumerate(prompts):
                expected = reference(torch.tensor([prompt])).logits[0, -1]
                assert (logits[row] - expected).abs().max().item() < TOLERANCE
        starts = [len(p) for p in prompts]
        for prompt, token in zip(prompts, logits.argmax(dim=-1).tolist(), strict=True):
            prompt.append(token)
        logits = model.forward(ForwardBatch([p[-1:] for p in prompts], starts, tables), cache)


def test_greedy_tokens_equal_transformers_generate(tiny_qwen2_dir: Path) -> None:
    runner = ModelRunner(tiny_qwen2_dir, 16, BLOCK_SIZE, quant_rows=0)
    reference = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    prompt = random_prompt(11, seed=4)
    with torch.inference_mode():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    min_new_tokens=12)[0, len(prompt):].tolist()
    table = list(range(8))
    ours = [int(runner.forward(ForwardBatch([prompt], [0], [table]))[0].argmax())]
    while len(ours) < 12:
        step = ForwardBatch([ours[-1:]], [len(prompt) + len(ours) - 1], [table])
        ours.append(int(runner.forward(step)[0].argmax()))
    assert ours == theirs

