"""`bench fidelity`: our greedy picks along transformers' answers, and where they part."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.fidelity import Answer, Verdict, judge, markdown, measure, reference_answers
from bench.gguf import SHAPES, write_random_gguf
from engine.weights.folder import model_folder
from tests.engine.weights.test_gguf import LLAMA3_ROPE, SMALL_VOCAB


def test_dense_products_pick_every_token_transformers_picked(tiny_model_dir: Path) -> None:
    answers = reference_answers(tiny_model_dir, torch.float32, 4, ["Hello", "What is 2 + 2?"])
    assert [len(a.tokens) for a in answers] == [4, 4]
    assert all(a.logits.shape[0] == 4 for a in answers)
    verdicts = measure(tiny_model_dir, torch.float32, answers, "dense")
    assert [v.first_difference for v in verdicts] == [None, None]
    assert max(v.max_logit_difference for v in verdicts) < 1e-3


def test_a_ggufs_answers_come_from_the_file_itself(tmp_path: Path) -> None:
    """The folder prepared from a GGUF holds no dense copy of its quantized matrices, so
    transformers reads them from the file, with the folder's config: Llama 3's rope scaling,
    which transformers leaves out of the file, included."""
    gguf = tmp_path / "random.gguf"
    write_random_gguf(gguf, SHAPES["tiny"], seed=6, scale=0.2, llama3_rope=LLAMA3_ROPE,
                      vocab=SMALL_VOCAB)
    folder = model_folder(str(gguf), tmp_path / "models")
    answers = reference_answers(folder, torch.float32, 4, ["Hello"], gguf=gguf)
    verdicts = measure(folder, torch.float32, answers, "quant")
    assert verdicts[0].first_difference is None and verdicts[0].max_logit_difference < 1e-3


def test_the_first_differing_pick_and_its_gap_are_found() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.5, 0.0, 0.4], [0.0, 0.0, 3.0]])
    answer = Answer(prompt=[1], tokens=[1, 0, 2], logits=logits)
    ours = logits.clone()
    ours[1] = torch.tensor([0.3, 0.0, 0.45])  # picks 2 where transformers picked 0
    ours[2] = torch.tensor([9.0, 0.0, 0.0])  # differs again later: only the first counts
    verdict = judge(answer, ours)
    assert verdict.first_difference == 1
    assert abs(verdict.gap - 0.1) < 1e-6  # transformers' 0.5 for its token, 0.4 for ours
    assert verdict.max_logit_difference == 9.0
    assert judge(answer, logits) == Verdict(None, 0.0, 0.0)


def test_the_table_names_each_differing_answer() -> None:
    text = markdown({"dense": [Verdict(None, 0.0, 1e-5)] * 2,
                     "int8": [Verdict(None, 0.0, 0.2), Verdict(3, 0.05, 1.5)]}, "float32", 8)
    assert "| dense | 2/2 | 0.0000 | - |" in text
    assert "| int8 | 1/2 | 1.5000 | q2 at token 3 (gap 0.050) |" in text
