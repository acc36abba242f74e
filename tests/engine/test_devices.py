"""The engine on each device this host has: the same code paths on the CPU (always) and on a
GPU (where torch sees one; skipped, saying so, where it does not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from core.messages import Sampling
from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner
from engine.sampling.sampler import draw, make_generator

BLOCK_SIZE = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42]]
STEPS = 6


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"no GPU here: torch {torch.__version__} sees none")
    return torch.device(request.param)


def greedy_ours(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of `prompts` prefilled together, then decoded together step by step."""
    tables = [runner.allocator.allocate(blocks_needed(len(p) + steps, BLOCK_SIZE))
              for p in prompts]
    logits = runner.forward(ForwardBatch(prompts, [0] * len(prompts), tables))
    tokens = [[t] for t in logits.argmax(dim=-1).tolist()]
    for _ in range(steps - 1):
        starts = [len(p) + len(seq) - 1 for p, seq in zip(prompts, tokens, strict=True)]
        batch = ForwardBatch([[seq[-1]] for seq in tokens], starts, tables)
        for seq, token in zip(tokens, runner.forward(batch).argmax(dim=-1).tolist(), strict=True):
            seq.append(token)
    return tokens


@torch.inference_mode()
def greedy_transformers(model: LlamaForCausalLM, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_greedy_tokens_equal_transformers_in_fp32(device: torch.device, cuda_graphs: bool,
                                                  tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=32, block_size=BLOCK_SIZE, device=device,
                         cuda_graphs=cuda_graphs)
    assert runner.cache.k.device.type == device.type
    assert (runner.graphs is not None) == (cuda_graphs and device.type == "cuda")
    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    torch.nn.Module.to(reference, device)  # (transformers types its own `to` as a decorator's)
    reference.eval()
    expected = [greedy_transformers(reference, prompt, STEPS) for prompt in PROMPTS]
    assert greedy_ours(runner, PROMPTS, STEPS) == expected


def test_bf16_logits_are_within_bf16_rounding_of_transformers(device: torch.device,
                                                              tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=8, block_size=BLOCK_SIZE,
                         dtype=torch.bfloat16, device=device)
    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    torch.nn.Module.to(reference, device)
    reference.eval()
    prompt = PROMPTS[0]
    table = runner.allocator.allocate(blocks_needed(len(prompt), BLOCK_SIZE))
    ours = runner.forward(ForwardBatch([prompt], [0], [table]))[0]
    with torch.inference_mode():
        theirs = reference(torch.tensor([prompt], device=device)).logits[0, -1].float()
    assert ours.device.type == device.type
    # Each side rounds to bf16 (8 bits of mantissa) in its own places: a few steps apart.
    scale = float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) <= 0.03 * scale
    assert int(ours.argmax()) == int(theirs.argmax())


def test_seeded_draws_repeat_on_the_device(device: torch.device) -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(device)
    params = [Sampling(temperature=0.8, top_p=0.9, seed=7), Sampling(temperature=0),
              Sampling(temperature=1.0, top_k=20, repetition_penalty=1.3, logprobs=2)]
    first, again = ([d.token_id for d in draw(logits, params,
                                              [make_generator(7, device) for _ in params])]
                    for _ in range(2))
    assert first == again
    assert first[1] == int(logits[1].argmax())


def test_kv_from_the_host_is_written_into_a_device_cache(device: torch.device,
                                                         tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_model_dir, num_blocks=4, block_size=BLOCK_SIZE, device=device)
    cache = runner.cache
    table = runner.allocator.allocate(2)
    k = torch.randn(cache.num_layers, 10, *cache.k.shape[2:])
    v = torch.randn_like(k)
    cache.write(table, 0, k, v)  # as KV arriving over a socket is
    got_k, got_v = cache.read(table, 10)
    assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
