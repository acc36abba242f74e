"""SimRunner: the real cache and allocator, the chain's tokens out of its logits, its KV the
only memory of a sequence, and the profile's step times slept."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from core.messages import Sampling
from engine.model.batch import ForwardBatch
from engine.sampling.sampler import sample
from engine.sim.folder import sim_folder
from engine.sim.runner import SimRunner
from engine.sim.tokens import continuation

BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sim_folder("default", tmp_path_factory.mktemp("models"))


def generate(runner: SimRunner, prompt: list[int], steps: int, table: list[int]) -> list[int]:
    """Prefill `prompt` in two chunks, then decode `steps` tokens greedily."""
    half = len(prompt) // 2
    runner.forward(ForwardBatch([prompt[:half]], [0], [table]))
    logits = runner.forward(ForwardBatch([prompt[half:]], [half], [table]))
    out = [int(logits[0].argmax())]
    for _ in range(steps - 1):
        logits = runner.forward(ForwardBatch([out[-1:]], [len(prompt) + len(out) - 1], [table]))
        out.append(int(logits[0].argmax()))
    return out


def test_greedy_tokens_are_the_chain_and_sampling_draws_them_too(folder: Path) -> None:
    runner = SimRunner(folder, 32, BLOCK, time_scale=0)
    prompt = list(b"Tell me about the sea, in twenty words.")
    expected = continuation(prompt, 30, runner.profile.mean_output_tokens)
    assert generate(runner, prompt, len(expected), list(range(20))) == expected
    logits = runner.forward(ForwardBatch([prompt], [0], [list(range(20, 32))]))
    hot = Sampling(temperature=2.0, repetition_penalty=1.3, seed=5)
    generators = [torch.Generator().manual_seed(seed) for seed in range(50)]
    assert sample(logits.expand(50, -1), [hot] * 50, generators) == [expected[0]] * 50


def test_a_made_up_hidden_state_follows_the_tokens_and_their_prefix(folder: Path) -> None:
    runner = SimRunner(folder, 32, BLOCK, time_scale=0)
    prompts = [list(b"The sea"), list(b"The sky"), list(b"The sea")]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    runner.forward(ForwardBatch(prompts, [0, 0, 0], tables, hidden=True))
    first, other, again = runner.hidden
    assert runner.hidden.shape == (3, runner.spec.hidden_size)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_a_sequence_remembers_only_through_its_kv(folder: Path) -> None:
    """Decoding on a second runner after its KV is copied over continues the chain; a block of
    that KV lost (zeros) derails it."""
    prompt = list(b"Where does the river end?")
    first = SimRunner(folder, 16, BLOCK, time_scale=0)
    first_token = int(first.forward(ForwardBatch([prompt], [0], [list(range(7))]))[0].argmax())
    expected = continuation(prompt, 12, first.profile.mean_output_tokens)
    k, v = first.cache.read(list(range(7)), len(prompt))
    second = SimRunner(folder, 16, BLOCK, time_scale=0)
    table = [9, 3, 8, 2, 10, 1, 11, 12, 13, 14]
    second.cache.write(table, 0, k, v)
    assert first_token == expected[0]
    out = [first_token]
    for _ in range(11):
        step = ForwardBatch([out[-1:]], [len(prompt) + len(out) - 1], [table])
        out.append(int(second.forward(step)[0].argmax()))
    assert out == expected
    second.cache.write(table, 0, torch.zeros_like(k), torch.zeros_like(v))
    derailed = second.forward(ForwardBatch([out[:1]], [len(prompt)], [table]))
    assert int(derailed[0].argmax()) != expected[1]


def test_steps_take_the_profiles_time_and_layer_hooks_share_it(folder: Path) -> None:
    runner = SimRunner(folder, 64, BLOCK, time_scale=2.0)
    batch = ForwardBatch([[65] * 200], [0], [list(range(50))])
    hooked: list[tuple[int, float]] = []
    began = time.monotonic()
    runner.forward(batch, lambda layer: hooked.append((layer, time.monotonic() - began)))
    took = time.monotonic() - began
    modeled = runner.profile.latency.step_s(batch) * 2.0
    assert modeled <= took < modeled + 0.05
    assert [layer for layer, _ in hooked] == list(range(runner.spec.num_layers))
    assert hooked[0][1] < modeled / 2 <= hooked[-1][1]


def test_kv_bytes_shrinks_the_cache_and_the_fingerprint_says_so(folder: Path) -> None:
    full = SimRunner(folder, 8, BLOCK, time_scale=0)
    tenth = SimRunner(folder, 8, BLOCK, kv_bytes=0.1, time_scale=0)
    assert full.cache.bytes_per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M's, in bf16
    assert tenth.cache.bytes_per_token == pytest.approx(full.cache.bytes_per_token / 10, rel=0.02)
    assert tenth.kv_fingerprint != full.kv_fingerprint
    assert tenth.kernel_isa == "sim" and tenth.device.type == "cpu"


def test_all_logits_give_each_position_s_next_chain_token(folder: Path) -> None:
    runner = SimRunner(folder, 16, BLOCK, time_scale=0)
    prompt = list(b"Count the waves.")
    logits = runner.forward(ForwardBatch([prompt], [0], [list(range(5))], all_logits=[True]))
    assert logits.shape[0] == len(prompt)
    again = SimRunner(folder, 16, BLOCK, time_scale=0)
    last = again.forward(ForwardBatch([prompt], [0], [list(range(5))]))
    assert torch.equal(logits[-1:], last)


def test_one_token_rows_over_the_same_blocks_follow_each_other(folder: Path) -> None:
    """A decode worker's guesses go as one-token rows of one pass, each at its position over
    the same blocks: each row sees the rows before it, as the model's attention does."""
    runner = SimRunner(folder, 16, BLOCK, time_scale=0)
    prompt = list(b"Name the tides.")
    expected = continuation(prompt, 4, runner.profile.mean_output_tokens)
    table = list(range(6))
    first = int(runner.forward(ForwardBatch([prompt], [0], [table]))[0].argmax())
    fed = [first, *expected[1:3]]  # the last token and two right guesses
    logits = runner.forward(ForwardBatch([[token] for token in fed],
                                         list(range(len(prompt), len(prompt) + 3)),
                                         [table] * 3))
    assert first == expected[0] and logits.argmax(dim=-1).tolist() == expected[1:4]
