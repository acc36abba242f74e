"""A worker split over two processes (rank 0 here, rank 1 started by it) against one process
and transformers; its shared KV cache; a rank lost; nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.gguf import SHAPES, write_random_gguf
from engine.locate import resolve_model
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner
from engine.tp.runner import TensorParallelRunner
from tests.engine.model.test_llama import TOLERANCE, random_prompt
from tests.engine.weights.test_gguf import SMALL_VOCAB

BLOCKS, BLOCK_SIZE = 32, 16


def greedy(runner: ModelRunner | TensorParallelRunner, prompts: list[list[int]],
           count: int) -> list[list[int]]:
    """`count` greedy tokens of each prompt, all in one batch."""
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    logits = runner.forward(ForwardBatch(prompts, [0] * len(prompts), tables))
    for _ in range(count):
        for tokens, token in zip(out, logits.argmax(dim=-1).tolist(), strict=True):
            tokens.append(token)
        starts = [len(p) + len(t) - 1 for p, t in zip(prompts, out, strict=True)]
        logits = runner.forward(ForwardBatch([t[-1:] for t in out], starts, tables))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_two_ranks_generate_what_one_process_and_transformers_do(
        family: str, tiny_model_dir: Path, request: pytest.FixtureRequest) -> None:
    folder = tiny_model_dir if family == "llama" else Path(
        request.getfixturevalue(f"tiny_{family}_dir"))
    prompts = [random_prompt(n, seed=n) for n in (7, 30)]
    split = TensorParallelRunner(folder, BLOCKS, BLOCK_SIZE, torch.float32, 2)
    try:
        ours = greedy(split, prompts, 10)
        alone = ModelRunner(folder, BLOCKS, BLOCK_SIZE, quant_rows=0)
        assert ours == greedy(alone, prompts, 10)
        context = slice(0, len(prompts[0]) + 10)  # the first sequence's KV: every rank's heads
        torch.testing.assert_close(split.cache.k[:, context], alone.cache.k[:, context])
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            for prompt, tokens in zip(prompts, ours, strict=True):
                theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=10,
                                            min_new_tokens=10, do_sample=False)
                assert theirs[0, len(prompt):].tolist() == tokens
            logits = split.forward(ForwardBatch([prompts[1]], [0], [list(range(8))],
                                                hidden=True))[0]
            expected = reference(torch.tensor([prompts[1]]), output_hidden_states=True)
            assert (logits - expected.logits[0, -1]).abs().max().item() < TOLERANCE
            # the last of transformers' hidden states is after the final norm
            hidden = expected.hidden_states[-1][0, -1]
            assert (split.hidden[0] - hidden).abs().max().item() < TOLERANCE
    finally:
        split.close()
    assert all(process.poll() is not None for process in split.ranks)


def test_the_shared_files_are_gone_once_every_rank_mapped_them(tiny_model_dir: Path) -> None:
    split = TensorParallelRunner(tiny_model_dir, BLOCKS, BLOCK_SIZE, torch.float32, 2)
    try:
        assert not Path(split.plan.kv_file).exists() and not Path(split.plan.store).exists()
    finally:
        split.close()


def test_a_rank_that_dies_is_reported_with_its_status(tiny_model_dir: Path) -> None:
    lost: list[tuple[int, int]] = []
    reported = threading.Event()

    def on_lost(rank: int, status: int) -> None:
        lost.append((rank, status))
        reported.set()

    split = TensorParallelRunner(tiny_model_dir, BLOCKS, BLOCK_SIZE, torch.float32, 2,
                                 on_rank_lost=on_lost)
    os.kill(split.ranks[0].pid, signal.SIGKILL)
    assert reported.wait(10)
    assert lost == [(1, -signal.SIGKILL)]
    with pytest.raises(RuntimeError):  # the step fails instead of waiting for the dead rank
        split.forward(ForwardBatch([[5, 6]], [0], [[0]]))


def test_a_split_the_model_does_not_allow_starts_no_rank(tiny_model_dir: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ValueError, match="does not divide"):
        TensorParallelRunner(tiny_model_dir, BLOCKS, BLOCK_SIZE, torch.float32, 3)
    assert set(os.listdir("/dev/shm")) == before


def test_the_ranks_die_with_their_worker(tiny_model_dir: Path) -> None:
    script = ("import sys, time, torch\n"
              "from engine.tp.runner import TensorParallelRunner\n"
              f"split = TensorParallelRunner({str(tiny_model_dir)!r}, 8, 16, torch.float32, 2)\n"
              "print(split.ranks[0].pid, flush=True)\n"
              "time.sleep(60)\n")
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        rank = int(worker.stdout.readline())
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{rank}").exists() and _state(rank) != "Z":
            assert time.monotonic() < deadline, "rank 1 outlived its worker"
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.kernels
def test_two_ranks_multiply_a_ggufs_quant_blocks_split(tmp_path: Path) -> None:
    gguf = tmp_path / "random.gguf"
    write_random_gguf(gguf, SHAPES["tiny"], seed=2, scale=0.2, vocab=SMALL_VOCAB)
    folder = resolve_model(str(gguf), tmp_path)
    split = TensorParallelRunner(folder, BLOCKS, BLOCK_SIZE, torch.float32, 2,
                                 weights="quant")
    try:
        assert all(not m.matrices and m.quant for m in split.model.matrices())
        alone = ModelRunner(folder, BLOCKS, BLOCK_SIZE, weights="quant")
        prompts = [random_prompt(n, seed=n, vocab=SMALL_VOCAB) for n in (9, 33)]
        assert greedy(split, prompts, 8) == greedy(alone, prompts, 8)
    finally:
        split.close()
