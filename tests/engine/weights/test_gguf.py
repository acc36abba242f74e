"""GGUF files read directly: the packaged model's blocks as transformers dequantizes them, a
random Llama GGUF's logits as transformers computes them from the same file, refusals."""

from __future__ import annotations

import filecmp
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from bench.gguf import SHAPES, write_random_gguf
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner
from engine.weights import gguf as gguf_module
from engine.weights.folder import DEFAULT_MODEL, model_folder, packaged_gguf
from engine.weights.gguf import hf_name, prepare_gguf, prepared_folder
from engine.weights.load import load_weights
from engine.weights.quant_blocks import dequantize, load_quant_blocks
from tests.engine.model.test_llama import TOLERANCE, random_prompt

# Llama 3's rope scaling, its blend band holding two of the tiny model's frequencies
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 8192}


# the random files' tokenizer: SmolLM2's first 1,024 tokens (transformers parses the whole one
# in seconds, and once per part it reads)
SMALL_VOCAB = 1024
RandomGguf = tuple[Path, Path, str]  # the file, its prepared folder, its mix


@pytest.fixture(scope="module")
def random_ggufs(tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[str, str], RandomGguf]:
    """A random small GGUF of a family (transformers reads these three) in a mix of quant
    types (bench.gguf.MIXES), made once per module (preparing one takes seconds)."""
    made: dict[tuple[str, str], RandomGguf] = {}

    def random_gguf(family: str, mix: str) -> RandomGguf:
        if (family, mix) not in made:
            folder = tmp_path_factory.mktemp("gguf")
            path = folder / f"random-{family}.gguf"
            shape = SHAPES["tiny" if mix == "q4_1" else "small"]  # K-quants: rows of 256
            write_random_gguf(path, shape, seed=3, scale=0.2,  # logits far apart
                              architecture=family, mix=mix, vocab=SMALL_VOCAB)
            made[family, mix] = path, model_folder(str(path), folder / "models"), mix
        return made[family, mix]

    return random_gguf


def test_the_packaged_gguf_read_directly_holds_what_transformers_dequantizes(
        real_model_dir: Path, tmp_path: Path) -> None:
    folder = model_folder(str(packaged_gguf(DEFAULT_MODEL)), tmp_path)
    ours, theirs = load_quant_blocks(folder), load_quant_blocks(real_model_dir)
    assert len(ours) == 211 and ours.keys() == theirs.keys()
    for name, matrix in ours.items():  # q and k rows back in transformers' order too
        assert matrix.bits == theirs[name].bits and torch.equal(matrix.packed,
                                                                theirs[name].packed), name
    dense = load_weights(folder, torch.float32)
    assert dense.keys().isdisjoint(ours)  # no dense copy of a matrix in quant blocks
    reference = load_weights(real_model_dir, torch.float32)
    assert all(torch.equal(tensor, reference[name]) for name, tensor in dense.items())
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert filecmp.cmp(folder / name, real_model_dir / name, shallow=False)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((folder / name).read_text()) == \
            json.loads((real_model_dir / name).read_text())


# (family, quant types), then the weights multiplied: both ways for our own formats; converted
# ones over their blocks (a dense copy of them is made as for any other)
GGUF_CASES = [(("llama", "q4_1"), "quant"), (("llama", "q4_1"), "dense"),
              (("qwen2", "q4_1"), "quant"), (("qwen2", "q4_1"), "dense"),
              (("qwen3", "q4_1"), "quant"),
              (("llama", "q4_k_m"), "quant"), (("llama", "every"), "quant"),
              (("qwen2", "every"), "quant")]


@pytest.mark.kernels
@pytest.mark.parametrize(("case", "weights"), GGUF_CASES,
                         ids=["-".join((*case, weights)) for case, weights in GGUF_CASES])
def test_a_random_gguf_gives_the_logits_transformers_computes(
        random_ggufs: Callable[[str, str], RandomGguf], case: tuple[str, str],
        weights: str) -> None:
    """From the file itself where its types are ours (Q4_1, Q8_0); from the values of the
    blocks they were converted to otherwise (engine.weights.gguf_blocks), each within 1 % of
    the largest value transformers read."""
    gguf, folder, mix = random_ggufs(*case)
    runner = ModelRunner(folder, 16, 16, weights=weights)  # type: ignore[arg-type]
    family = gguf.stem.removeprefix("random-")
    assert json.loads((folder / "config.json").read_text())["model_type"] == family
    assert runner.spec.qkv_bias == (family == "qwen2")
    assert runner.spec.qk_norm == (family == "qwen3")
    assert all(bool(m.matrices) == (weights == "dense") for m in runner.model.matrices())
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent,
                                                     gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    if mix != "q4_1":
        reference.load_state_dict(converted_weights(folder, reference), strict=False)
    prompt = random_prompt(40, seed=1, vocab=SMALL_VOCAB)
    logits = runner.forward(ForwardBatch([prompt], [0], [[0, 1, 2, 3]]))[0]
    for _ in range(4):
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0, -1]
        assert (logits - expected).abs().max().item() < TOLERANCE
        prompt.append(int(logits.argmax()))
        step = ForwardBatch([prompt[-1:]], [len(prompt) - 1], [[0, 1, 2, 3]])
        logits = runner.forward(step)[0]


def converted_weights(folder: Path, reference: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The values of the folder's quant blocks, each checked against transformers' own."""
    theirs = reference.state_dict()
    ours = {name: dequantize(matrix) for name, matrix in load_quant_blocks(folder).items()}
    assert len(ours) == sum(name.endswith("proj.weight") for name in theirs) + 1 + \
        (reference.config.tie_word_embeddings is False)  # every matrix: none left dense
    for name, values in ours.items():
        assert (values - theirs[name]).abs().max() <= theirs[name].abs().max() / 100, name
    return ours


def test_a_gguf_of_another_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = GGUFWriter(path, "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma' is not supported: llama, mistral, qwen2"):
        prepare_gguf(path, tmp_path / "prepared")
    assert not (tmp_path / "prepared").exists()
    assert not (tmp_path / "prepared.partial").exists()


def test_tensor_names_map_to_hugging_faces() -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_a_file_changed_in_place_or_a_new_preparation_prepares_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"one")
    before = prepared_folder(path, tmp_path)
    path.write_bytes(b"other")
    moved = prepared_folder(path, tmp_path)
    assert moved != before
    assert before.name == "model"  # the name it is served under
    monkeypatch.setattr(gguf_module, "PREPARATION", gguf_module.PREPARATION + 1)
    assert prepared_folder(path, tmp_path) not in (before, moved)  # a new way of preparing


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        model_folder(str(tmp_path / "absent.gguf"), tmp_path)


@pytest.mark.kernels
def test_a_llama_3_gguf_keeps_its_rope_scaling(tmp_path: Path) -> None:
    """llama.cpp writes Llama 3's rope scaling as a divisor per frequency, which transformers
    reading the file leaves out: the prepared config has it back, and the logits are those of
    transformers given that config."""
    scaling = LLAMA3_ROPE
    gguf = tmp_path / "llama-3.gguf"
    write_random_gguf(gguf, SHAPES["tiny"], seed=4, scale=0.2, llama3_rope=scaling,
                      vocab=SMALL_VOCAB)
    folder = model_folder(str(gguf), tmp_path / "models")
    assert json.loads((folder / "config.json").read_text())["rope_parameters"] == \
        {"rope_theta": 10000.0, **scaling}
    runner = ModelRunner(folder, 16, 16)
    prompt = random_prompt(60, seed=2, vocab=SMALL_VOCAB)
    logits = runner.forward(ForwardBatch([prompt], [0], [[0, 1, 2, 3]]))[0]
    plain, scaled = (AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **config).eval()
        for config in ({}, {"config": AutoConfig.from_pretrained(folder)}))
    with torch.inference_mode():
        assert (logits - scaled(torch.tensor([prompt])).logits[0, -1]).abs().max() < TOLERANCE
        assert (logits - plain(torch.tensor([prompt])).logits[0, -1]).abs().max() > 0.01
