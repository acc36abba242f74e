"""Greedy generation on the real SmolLM2 model: identical to transformers' generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner

pytestmark = pytest.mark.realmodel

NEW_TOKENS = 24
BLOCK_SIZE = 16
PAD = 2  # <|im_end|>, as the model's generation config pads
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Tell me a short joke.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "What does CPU stand for?",
    "Suggest a name for a pet cat.",
    "How many legs does a spider have?",
    "What is the largest planet in our solar system?",
    "Describe a sunset in five words.",
    "What is the opposite of cold?",
    "Hi!",
]


@pytest.fixture(scope="module")
def prompts(real_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def transformers_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt's greedy tokens from one batched generate(), the prompts left-padded as
    transformers pads them (one prompt at a time took 33 s, the batch 4 s, the same tokens)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run all NEW_TOKENS steps, past any EOS
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    return out[:, width:].tolist()


def interleaved_tables(runner: ModelRunner, lengths: list[int]) -> list[list[int]]:
    """Block tables allocated one block per sequence in turn, so no table is contiguous."""
    needed = [blocks_needed(n, BLOCK_SIZE) for n in lengths]
    tables: list[list[int]] = [[] for _ in lengths]
    for round_ in range(max(needed)):
        for table, count in zip(tables, needed, strict=True):
            if round_ < count:
                table += runner.allocator.allocate(1)
    return tables


def our_greedy(folder: Path, prompts: list[list[int]], quant_rows: int) -> list[list[int]]:
    """Prefill every prompt in one batch, then decode all sequences together."""
    runner = ModelRunner(folder, num_blocks=len(prompts) * 8, block_size=BLOCK_SIZE,
                         quant_rows=quant_rows)
    tables = interleaved_tables(runner, [len(p) + NEW_TOKENS for p in prompts])
    logits = runner.forward(ForwardBatch(prompts, [0] * len(prompts), tables))
    generated = [[token] for token in logits.argmax(dim=-1).tolist()]
    for step in range(NEW_TOKENS - 1):
        starts = [len(p) + step for p in prompts]
        logits = runner.forward(ForwardBatch([g[-1:] for g in generated], starts, tables))
        for tokens, token in zip(generated, logits.argmax(dim=-1).tolist(), strict=True):
            tokens.append(token)
    return generated


@pytest.fixture(scope="module")
def expected(real_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(real_model_dir, prompts)


# Decode steps (20 rows) dense, or over the GGUF's 4-bit quant blocks (the same fp32 weights).
@pytest.mark.parametrize("quant_rows", [0, len(PROMPTS)], ids=["dense", "quant"])
def test_greedy_tokens_match_transformers(real_model_dir: Path, prompts: list[list[int]],
                                          expected: list[list[int]], quant_rows: int) -> None:
    ours = our_greedy(real_model_dir, prompts, quant_rows)
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)
    for prompt_ids, theirs, mine in zip(prompts, expected, ours, strict=True):
        assert mine == theirs, prompt_ids
