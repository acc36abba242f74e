"""Our Llama forward against transformers' LlamaForCausalLM on tiny random models."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from engine.kv.cache import PagedKVCache
from engine.model.batch import ForwardBatch
from engine.model.linear import PACKED, PLAIN, can_pack_bf16
from engine.model.llama import LlamaModel
from engine.runner import ModelRunner
from engine.weights.load import load_weights
from engine.weights.quant_blocks import load_quant_blocks
from engine.weights.spec import load_spec

BLOCK_SIZE = 4
NUM_BLOCKS = 128
TOLERANCE = 1e-3
needs_mkldnn_bf16 = pytest.mark.skipif(not can_pack_bf16(),
                                       reason="oneDNN has no bf16 path on this CPU")


class Fixture:
    """Our model with a fresh cache, whose blocks are handed out in shuffled order."""

    def __init__(self, folder: Path) -> None:
        spec = load_spec(folder)
        self.model = LlamaModel(spec, load_weights(folder, torch.float32))
        self.cache = PagedKVCache(spec, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
        self.hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def reference(self, ids: list[int]) -> torch.Tensor:
        """transformers' logits of the last token of `ids`, without any cache."""
        with torch.inference_mode():
            return self.hf(torch.tensor([ids])).logits[0, -1].float()


@pytest.fixture
def tiny(tiny_model_dir: Path) -> Fixture:
    return Fixture(tiny_model_dir)


def random_prompt(length: int, seed: int, vocab: int = 49152) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def assert_close(logits: torch.Tensor, expected: torch.Tensor) -> None:
    assert (logits - expected).abs().max().item() < TOLERANCE


def greedy_pair(folder: Path, prompt: list[int], count: int,
                chunks: tuple[int, ...] = ()) -> tuple[list[int], list[int]]:
    """`count` greedy tokens of `prompt` from our runner (its prompt prefilled in chunks cut
    at `chunks`, then one token a step) and from transformers' `generate`."""
    runner = ModelRunner(folder, 64, BLOCK_SIZE, quant_rows=0)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=count,
                                    do_sample=False, min_new_tokens=count)[0, len(prompt):]
    table = list(range(64))
    cuts = [0, *chunks, len(prompt)]
    for begin, end in pairwise(cuts):
        logits = runner.forward(ForwardBatch([prompt[begin:end]], [begin], [table]))
    ours = [int(logits[0].argmax())]
    while len(ours) < count:
        step = ForwardBatch([ours[-1:]], [len(prompt) + len(ours) - 1], [table])
        ours.append(int(runner.forward(step)[0].argmax()))
    return ours, theirs.tolist()


def assert_decode_logits_match(folder: Path, lengths: tuple[int, ...], steps: int) -> None:
    """Prompts of `lengths` prefilled in one batch, then `steps` batched decode steps: every
    step's logits as transformers computes them over the whole sequence, with no cache."""
    spec = load_spec(folder)
    model = LlamaModel(spec, load_weights(folder, torch.float32))
    cache = PagedKVCache(spec, 64, BLOCK_SIZE, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [random_prompt(n, seed=n) for n in lengths]
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    logits = model.forward(ForwardBatch(prompts, [0] * len(prompts), tables), cache)
    for _ in range(steps):
        with torch.inference_mode():
            for row, prompt in enumerate(prompts):
                assert_close(logits[row], reference(torch.tensor([prompt])).logits[0, -1])
        starts = [len(p) for p in prompts]
        for prompt, token in zip(prompts, logits.argmax(dim=-1).tolist(), strict=True):
            prompt.append(token)
        logits = model.forward(ForwardBatch([p[-1:] for p in prompts], starts, tables), cache)


def test_prefill_batch_of_different_lengths(tiny: Fixture) -> None:
    prompts = [random_prompt(n, seed=n) for n in (1, 4, 8, 7, 13, 33)]  # 4, 8: whole blocks
    tables = [tiny.blocks(len(p)) for p in prompts]
    logits = tiny.model.forward(ForwardBatch(prompts, [0] * len(prompts), tables), tiny.cache)
    assert logits.shape == (len(prompts), 49152) and logits.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        assert_close(logits[row], tiny.reference(prompt))


def test_batched_decode_after_prefill(tiny: Fixture) -> None:
    sequences = [random_prompt(n, seed=100 + n) for n in (3, 9, 16, 1)]
    tables = [tiny.blocks(len(s) + 8) for s in sequences]
    logits = tiny.model.forward(ForwardBatch(sequences, [0] * 4, tables), tiny.cache)
    for _ in range(8):
        starts = [len(s) for s in sequences]
        for sequence, token in zip(sequences, logits.argmax(dim=-1).tolist(), strict=True):
            sequence.append(token)
        new = [s[-1:] for s in sequences]
        logits = tiny.model.forward(ForwardBatch(new, starts, tables), tiny.cache)
        for row, sequence in enumerate(sequences):
            assert_close(logits[row], tiny.reference(sequence))


def test_chunked_prefill_mixed_with_decode(tiny: Fixture) -> None:
    prompt, other = random_prompt(30, seed=1), random_prompt(6, seed=2)
    table, other_table = tiny.blocks(30), tiny.blocks(7)
    first = tiny.model.forward(ForwardBatch([prompt[:13], other], [0, 0], [table, other_table]),
                               tiny.cache)
    assert_close(first[0], tiny.reference(prompt[:13]))
    next_token = int(first[1].argmax())
    batch = ForwardBatch([prompt[13:], [next_token]], [13, 6], [table, other_table])
    second = tiny.model.forward(batch, tiny.cache)
    assert_close(second[0], tiny.reference(prompt))
    assert_close(second[1], tiny.reference([*other, next_token]))


def test_all_logits_are_every_position_s_as_transformers_across_chunks(tiny: Fixture) -> None:
    """A prompt asking for all its rows' logits, in two chunks beside a decode step: each
    position's logits are transformers' for the prompt up to there."""
    prompt, other = random_prompt(21, seed=3), random_prompt(5, seed=4)
    table, other_table = tiny.blocks(21), tiny.blocks(8)
    tiny.model.forward(ForwardBatch([other], [0], [other_table]), tiny.cache)
    rows = []
    for begin, end in ((0, 9), (9, 21)):
        logits = tiny.model.forward(ForwardBatch(
            [prompt[begin:end], [7]], [begin, 5 + begin // 9], [table, other_table],
            all_logits=[True, False]), tiny.cache)
        assert logits.shape == (end - begin + 1, 49152)
        rows.append(logits[:-1])
    with torch.inference_mode():
        expected = tiny.hf(torch.tensor([prompt])).logits[0].float()
    assert_close(torch.cat(rows), expected)


def test_layer_hook_runs_once_each_layer_is_in_the_cache(tiny: Fixture) -> None:
    prompt = random_prompt(10, seed=3)
    table = tiny.blocks(10)
    slots = tiny.cache.slots(table, 0, 10)
    seen: list[tuple[int, torch.Tensor, float]] = []

    def hook(layer: int) -> None:
        # Snapshot this layer's K, and the mass of all later layers' K (not written yet).
        later = tiny.cache.k[layer + 1 :, slots].abs().sum().item()
        seen.append((layer, tiny.cache.k[layer, slots].clone(), later))

    tiny.model.forward(ForwardBatch([prompt], [0], [table]), tiny.cache, layer_hook=hook)
    assert [layer for layer, _, _ in seen] == list(range(tiny.model.spec.num_layers))
    for layer, written, later in seen:
        assert written.abs().sum() > 0 and torch.equal(written, tiny.cache.k[layer, slots])
        assert later == 0.0


def test_positions_beyond_the_model_are_rejected(tiny: Fixture) -> None:
    table = list(range(2048 // BLOCK_SIZE + 1))
    cache = PagedKVCache(tiny.model.spec, len(table), BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError):
        tiny.model.forward(ForwardBatch([[5]], [2048], [table]), cache)


@pytest.mark.parametrize("token", [-1, 49152])
def test_token_ids_outside_the_vocabulary_are_rejected(tiny: Fixture, token: int) -> None:
    with pytest.raises(ValueError):
        tiny.model.forward(ForwardBatch([[5, token]], [0], [tiny.blocks(2)]), tiny.cache)


def test_block_table_too_short_is_rejected(tiny: Fixture) -> None:
    with pytest.raises(ValueError):
        tiny.model.forward(ForwardBatch([random_prompt(9, seed=4)], [0], [[0, 1]]), tiny.cache)


ROPE_SCALINGS = {
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"factor": 4.0},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(
    rope_type: str, make_tiny_model: Callable[..., Path]
) -> None:
    parameters = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_SCALINGS[rope_type]}
    scaled = Fixture(make_tiny_model(rope_parameters=parameters))
    assert scaled.model.spec.rope_scaling is not None
    prompts = [random_prompt(150, seed=5), random_prompt(90, seed=6)]
    tables = [scaled.blocks(len(p)) for p in prompts]
    logits = scaled.model.forward(ForwardBatch(prompts, [0, 0], tables), scaled.cache)
    for row, prompt in enumerate(prompts):
        assert_close(logits[row], scaled.reference(prompt))


def test_dynamic_rope_past_the_original_length_generates_what_transformers_does(
        make_tiny_model: Callable[..., Path]) -> None:
    folder = make_tiny_model(max_position_embeddings=32,
                             rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                              "rope_theta": 10000.0})
    assert load_spec(folder).max_position_embeddings == 128
    ours, theirs = greedy_pair(folder, random_prompt(20, seed=8), 60)  # to position 80
    assert ours == theirs


@needs_mkldnn_bf16
def test_bf16_packed_weights_give_the_plain_bf16_logits(tiny_model_dir: Path) -> None:
    spec = load_spec(tiny_model_dir)
    weights = load_weights(tiny_model_dir, torch.bfloat16)
    ids = random_prompt(21, seed=3)
    logits = {}
    for layout in (PLAIN, PACKED):
        model = LlamaModel(spec, weights, layout)
        cache = PagedKVCache(spec, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16)
        table = list(range(-(-(len(ids) + 1) // BLOCK_SIZE)))
        prefill = model.forward(ForwardBatch([ids], [0], [table]), cache)
        step = model.forward(ForwardBatch([[int(prefill.argmax())]], [len(ids)], [table]), cache)
        logits[layout.packed] = torch.cat([prefill, step])
    torch.testing.assert_close(logits[True], logits[False], atol=2e-2, rtol=2e-2)


def test_bf16_logits_stay_near_fp32(tiny: Fixture, tiny_model_dir: Path) -> None:
    spec = load_spec(tiny_model_dir)
    model = LlamaModel(spec, load_weights(tiny_model_dir, torch.bfloat16))
    cache = PagedKVCache(spec, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16)
    ids = random_prompt(30, seed=4)
    logits = model.forward(ForwardBatch([ids], [0], [tiny.blocks(len(ids))]), cache)
    expected = tiny.reference(ids)
    assert (logits[0] - expected).abs().max().item() < 0.05 * expected.abs().max().item()


@pytest.mark.kernels
def test_products_over_the_quant_blocks_give_the_dense_logits(quant_model_dir: Path) -> None:
    spec = load_spec(quant_model_dir)
    weights = load_weights(quant_model_dir, torch.float32)
    quant = load_quant_blocks(quant_model_dir)
    prompts = [random_prompt(n, seed=n) for n in (3, 6)]
    logits = []
    for quant_rows in (0, 16):  # never over the quant blocks; every step of this test over them
        model = LlamaModel(spec, weights, quant=quant, quant_rows=quant_rows)
        assert model.quant_rows == quant_rows and model.lm_head.quant
        cache = PagedKVCache(spec, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
        tables = [list(range(3)), list(range(3, 6))]
        prefill = model.forward(ForwardBatch(prompts, [0, 0], tables), cache)
        step = model.forward(ForwardBatch([[7], [8]], [3, 6], tables), cache)
        logits.append(torch.cat([prefill, step]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_a_model_without_quant_blocks_never_uses_them(tiny_model_dir: Path) -> None:
    model = LlamaModel(load_spec(tiny_model_dir), load_weights(tiny_model_dir, torch.float32))
    assert model.quant_rows == 0 and not model.lm_head.quant
