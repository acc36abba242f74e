"""How far our greedy tokens are from transformers', per way of computing the products.

    python -m bench fidelity [--variant dense --variant quant --variant int8] [--max-tokens 32]

transformers' own greedy `generate` answers 20 chat questions (from the GGUF file itself, where
`--model` is one); our runner then reads each answer teacher-forced (its prompt prefilled, then
one decode step per answer token, as a decode worker computes them) and picks its own greedy
token at every position. An answer is equal when every pick is transformers' token. Where one
differs, the first such position tells how near a tie it was: transformers' logit of its own
token minus its logit of ours (the gap a rounding difference had to cross). Variants (all in
`--dtype`): `dense` (every product dense, `model.quant_rows: 0`), `quant` (decode steps over the
quant blocks, `model.quant_inputs: exact`) and `int8` (the same with inputs quantized to 8
bits, `model.quant_inputs: int8`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.report import table
from core.config import QuantInputs
from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue?",
    "Give me a tip for sleeping better.",
    "What does a CPU do?",
    "Write one sentence about autumn.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet turtle.",
    "What is the difference between weather and climate?",
    "How do I reverse a list in Python?",
    "What is the largest planet in the solar system?",
    "Describe a cat in three words.",
    "What should I pack for a day at the beach?",
)
BLOCK_SIZE = 16
VARIANTS: dict[str, tuple[int, QuantInputs]] = {  # name: (model.quant_rows, model.quant_inputs)
    "dense": (0, "exact"),
    "quant": (1, "exact"),
    "int8": (1, "int8"),
}


@dataclass(frozen=True)
class Answer:
    """transformers' greedy answer to one question, and its logits at each answer token."""

    prompt: list[int]
    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab], fp32


@dataclass(frozen=True)
class Verdict:
    """Ours against one answer: the first position our pick differs (None: equal) and the gap
    there; the largest logit difference along the answer."""

    first_difference: int | None
    gap: float
    max_logit_difference: float


def reference_answers(folder: Path, dtype: torch.dtype, max_tokens: int,
                      questions: Sequence[str] = QUESTIONS,
                      gguf: Path | None = None) -> list[Answer]:
    """transformers' answers, from the model folder, or from the GGUF file `gguf` it was
    prepared from (the folder then holds no dense copy of the quantized matrices), with the
    folder's config (which has the rope scaling transformers leaves out of a Llama 3 GGUF)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    tokenizer = AutoTokenizer.from_pretrained(folder)
    source = {"pretrained_model_name_or_path": folder} if gguf is None else \
        {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name,
         "config": AutoConfig.from_pretrained(folder)}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype).eval()
    answers = []
    with torch.inference_mode():
        for question in questions:
            encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                    add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)
            assert isinstance(encoded, BatchEncoding)
            ids = encoded["input_ids"]
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            logits = model(out[:, :-1]).logits[0, ids.shape[1] - 1:].float()
            answers.append(Answer(ids[0].tolist(), out[0, ids.shape[1]:].tolist(), logits))
    return answers


def teacher_forced_logits(runner: ModelRunner, answer: Answer) -> torch.Tensor:
    """Our logits at each answer token: the prompt prefilled, then one decode step per token."""
    length = len(answer.prompt) + len(answer.tokens)
    table = runner.allocator.allocate(blocks_needed(length, runner.block_size))
    try:
        logits = [runner.forward(ForwardBatch([answer.prompt], [0], [table]))[0]]
        for position, token in enumerate(answer.tokens[:-1], start=len(answer.prompt)):
            logits.append(runner.forward(ForwardBatch([[token]], [position], [table]))[0])
        return torch.stack(logits)
    finally:
        runner.allocator.free(table)


def judge(answer: Answer, ours: torch.Tensor) -> Verdict:
    picks = ours.argmax(-1).tolist()
    differing = [i for i, (pick, token) in enumerate(zip(picks, answer.tokens, strict=True))
                 if pick != token]
    first = differing[0] if differing else None
    gap = 0.0 if first is None else float(answer.logits[first, answer.tokens[first]] -
                                          answer.logits[first, picks[first]])
    return Verdict(first, gap, float((ours - answer.logits).abs().max()))


def measure(folder: Path, dtype: torch.dtype, answers: Sequence[Answer],
            variant: str) -> list[Verdict]:
    quant_rows, inputs = VARIANTS[variant]
    longest = max(len(a.prompt) + len(a.tokens) for a in answers)
    runner = ModelRunner(folder, blocks_needed(longest, BLOCK_SIZE), BLOCK_SIZE, dtype,
                         quant_rows, inputs)
    return [judge(answer, teacher_forced_logits(runner, answer)) for answer in answers]


def markdown(verdicts: dict[str, list[Verdict]], dtype: str, max_tokens: int) -> str:
    rows = []
    for variant, found in verdicts.items():
        differing = [(i, v) for i, v in enumerate(found) if v.first_difference is not None]
        where = "; ".join(f"q{i + 1} at token {v.first_difference} (gap {v.gap:.3f})"
                          for i, v in differing) or "-"
        rows.append([variant, f"{len(found) - len(differing)}/{len(found)}",
                     f"{max(v.max_logit_difference for v in found):.4f}", where])
    header = [f"variant ({dtype}, {max_tokens} tokens)", "answers equal to transformers'",
              "largest logit difference", "first differing token (transformers' gap)"]
    return table(header, rows)
