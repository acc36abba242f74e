"""The engine on a GPU, against transformers on the same GPU and against itself colocated.

    python -m bench gpu prepare --tokenizer DIR [--out DIR]
    python -m bench gpu decode --model DIR [--batch-sizes 1,64] [--context 128] [--steps 64]
    python -m bench gpu ttft --model DIR [--input-len 2000] [--repeats 5]
    python -m bench gpu bundle [--wheels .whl] [--python-version 3.12]   (here, before a GPU run)

`prepare` writes model folders of random weights (a GPU machine without network has no
weights to download): the default model's shape, where the tests and a cluster find the
default model, and Llama-3.2-1B's layers with the default tokenizer's vocabulary, for the
figures. `decode` times one decode step of a batch (bf16, CUDA graphs on and off, sampled ids
copied to the host as a worker does) against the per-token time of transformers' `generate`
(greedy, the same prompts). `ttft` streams the same prompts, one at a time, through
`launch.sh --prefill 1 --decode 1` (KV by cuda_ipc) and `--colocated 1` on one GPU.
`bundle` gathers, on a machine with network, what the others need where there is none
(bench/gpu_bundle.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from bench import gpu_bundle
from bench.client import served_model, stream_request
from bench.launcher import PURE_DISAGG, launched
from bench.prompts import TokenPrompts
from bench.workloads import RequestSpec
from core.config import ModelConfig
from engine.kv.allocator import blocks_needed
from engine.locate import resolve_model
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner
from engine.weights.files import QUANT_FILE, READY_MARKER

# Llama-3.2-1B's layers (its vocabulary is the default tokenizer's, so prompts tokenize).
SHAPE_1B: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": True,
}
BLOCK_SIZE = 16


def random_model(tokenizer_dir: Path, target: Path, overrides: dict[str, Any],
                 dtype: torch.dtype) -> Path:
    """A model folder at `target`: `tokenizer_dir`'s config with `overrides`, random weights
    (made on the GPU, saved in `dtype`), its tokenizer files, marked prepared."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((tokenizer_dir / "config.json").read_text())
    config.update(overrides, architectures=["LlamaForCausalLM"], model_type="llama")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**config))
        torch.nn.Module.to(model, dtype)  # (transformers types its own `to` as a decorator's)
    model.save_pretrained(target)
    for name in gpu_bundle.TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    (target / READY_MARKER).write_text("random weights (bench gpu prepare)\n")
    (target / QUANT_FILE).write_bytes(b"")  # no quant blocks: nothing to find in random weights
    return target


def prepare(tokenizer_dir: Path, default_dir: Path, out: Path) -> list[Path]:
    """The default model's shape in fp32 at `default_dir`, and the 1B shape in bf16 under
    `out`."""
    default = random_model(tokenizer_dir, default_dir, {}, torch.float32)
    return [default, random_model(tokenizer_dir, out / "llama-1b-shape", SHAPE_1B,
                                  torch.bfloat16)]


@dataclass(frozen=True)
class DecodeFigure:
    batch: int
    graphs_ms: float
    eager_ms: float
    transformers_ms: float

    @property
    def speedup(self) -> float:
        return self.transformers_ms / self.graphs_ms


def _prompts(batch: int, context: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(10, vocab, (batch, context), generator=generator).tolist()


def our_step_ms(runner: ModelRunner, prompts: list[list[int]], steps: int) -> float:
    """Median milliseconds of a decode step of all `prompts` together (after prefilling them),
    the sampled ids copied to the host each step."""
    tables = [runner.allocator.allocate(blocks_needed(len(p) + steps + 4, BLOCK_SIZE))
              for p in prompts]
    logits = runner.forward(ForwardBatch(prompts, [0] * len(prompts), tables))
    tokens = logits.argmax(dim=-1).tolist()
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        batch = ForwardBatch([[t] for t in tokens], [len(p) + step for p in prompts], tables)
        tokens = runner.forward(batch).argmax(dim=-1).tolist()
        times.append(time.perf_counter() - start)
    for table in tables:
        runner.allocator.free(table)
    return statistics.median(times[3:]) * 1e3  # the first steps capture graphs


@torch.inference_mode()
def transformers_step_ms(model: Any, prompts: list[list[int]], steps: int) -> float:
    """transformers' `generate`, greedy: (time for steps + 1 tokens - time for 1) / steps."""
    ids = torch.tensor(prompts, device="cuda")

    def seconds(tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds(2)  # warm-up
    return (min(seconds(steps + 1) for _ in range(2)) - min(seconds(1) for _ in range(2))) \
        / steps * 1e3


def measure_decode(folder: Path, batch_sizes: Sequence[int], context: int, steps: int
                   ) -> list[DecodeFigure]:
    from transformers import AutoModelForCausalLM

    blocks = max(batch_sizes) * blocks_needed(context + steps + 8, BLOCK_SIZE)
    graphed = ModelRunner(folder, blocks, BLOCK_SIZE, torch.bfloat16, device="cuda")
    eager = ModelRunner(folder, blocks, BLOCK_SIZE, torch.bfloat16, device="cuda",
                        cuda_graphs=False)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    torch.nn.Module.to(reference, "cuda")
    reference.eval()
    vocab = graphed.spec.vocab_size
    figures = []
    for batch in batch_sizes:
        prompts = _prompts(batch, context, vocab)
        figures.append(DecodeFigure(batch, our_step_ms(graphed, prompts, steps),
                                    our_step_ms(eager, prompts, steps),
                                    transformers_step_ms(reference, prompts, steps)))
    return figures


def decode_markdown(figures: list[DecodeFigure], context: int) -> str:
    rows = [f"| batch | ours, CUDA graphs (ms/step) | ours, eager | transformers generate | "
            f"speedup (context {context}) |", "|---|---|---|---|---|"]
    rows += [f"| {f.batch} | {f.graphs_ms:.2f} | {f.eager_ms:.2f} | {f.transformers_ms:.2f} | "
             f"{f.speedup:.2f}x |" for f in figures]
    return "\n".join(rows)


async def _ttfts(url: str, prompts: list[tuple[int, ...]]) -> list[float]:
    """Seconds to the first streamed token of each prompt, one at a time, after 2 warm-ups."""
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = await served_model(client)
        for index, prompt in enumerate([*prompts[:2], *prompts]):
            spec = RequestSpec(index, "fixed", prompt, len(prompt), 2)
            result = await stream_request(client, model, spec, 120, time.perf_counter())
            if not result.ok or not result.chunk_times_s:
                raise RuntimeError(f"request {index} failed: {result.error}")
            times.append(result.chunk_times_s[0])
    return times[2:]


def measure_ttft(folder: Path, input_len: int, repeats: int) -> dict[str, float]:
    """Median TTFT (ms) of each layout on one GPU."""
    maker = TokenPrompts(folder)
    prompts = [maker.prompt(index, input_len) for index in range(repeats)]
    layouts = {"1P+1D (cuda_ipc)": ["--prefill", "1", "--decode", "1", *PURE_DISAGG],
               "colocated 1": ["--colocated", "1"]}
    common = ["--model", str(folder), "--no-pin", "--set", "model.device=cuda",
              "--set", "model.dtype=bfloat16", "--set", "prefill.gpu_memory_fraction=0.3",
              "--set", "decode.gpu_memory_fraction=0.3"]
    medians = {}
    for name, flags in layouts.items():
        with launched([*flags, *common]) as server:
            medians[name] = statistics.median(asyncio.run(_ttfts(server.url, prompts))) * 1e3
    return medians


def ttft_markdown(medians: dict[str, float], input_len: int) -> str:
    colocated = medians["colocated 1"]
    rows = [f"| layout | TTFT p50 ms ({input_len}-token prompt) | vs colocated |",
            "|---|---|---|"]
    rows += [f"| {name} | {ms:.1f} | {ms / colocated:.2f}x |" for name, ms in medians.items()]
    return "\n".join(rows)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench gpu prepare|decode|ttft`."""
    parser = commands.add_parser("gpu", help="on a GPU: decode steps vs transformers, TTFT "
                                             "disaggregated vs colocated", description=__doc__)
    parser.add_argument("action", choices=("prepare", "decode", "ttft", "bundle"))
    parser.add_argument("--tokenizer", type=Path, help="prepare: a folder with the default "
                        "model's config and tokenizer files")
    parser.add_argument("--default-dir", type=Path,
                        default=Path("~/.cache/raging/models/SmolLM2-135M-Instruct"),
                        help="prepare: where the default model's shape goes")
    parser.add_argument("--out", type=Path, default=Path("/tmp/raging-gpu-models"),
                        help="prepare: where the 1B shape goes")
    parser.add_argument("--model", type=Path, help="decode, ttft: the model folder")
    parser.add_argument("--batch-sizes", type=_ints, default=(1, 64))
    parser.add_argument("--context", type=int, default=128, help="decode: prompt tokens")
    parser.add_argument("--steps", type=int, default=64, help="decode: steps timed")
    parser.add_argument("--input-len", type=int, default=2000, help="ttft: prompt tokens")
    parser.add_argument("--repeats", type=int, default=5, help="ttft: prompts per layout")
    parser.add_argument("--wheels", type=Path, default=gpu_bundle.ROOT / ".whl",
                        help="bundle: where the wheels and the tokenizer go")
    parser.add_argument("--python-version", default="3.12",
                        help="bundle: the GPU machine's Python, which the wheels are for")
    parser.set_defaults(prepare=_prepare_job)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _prepare_job(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.action == "prepare":
        if args.tokenizer is None:
            raise ValueError("prepare needs --tokenizer")
        return lambda: _print(prepare(args.tokenizer, args.default_dir.expanduser(), args.out))
    if args.action == "bundle":
        model = ModelConfig()
        return lambda: _print(gpu_bundle.bundle(resolve_model(model.name, model.cache_dir),
                                                args.wheels, args.python_version))
    if args.model is None:
        raise ValueError(f"{args.action} needs --model")
    if not torch.cuda.is_available():
        raise ValueError(f"no GPU here: torch {torch.__version__} sees none")
    if args.action == "decode":
        return lambda: _print(decode_markdown(
            measure_decode(args.model, args.batch_sizes, args.context, args.steps),
            args.context))
    return lambda: _print(ttft_markdown(measure_ttft(args.model, args.input_len, args.repeats),
                                        args.input_len))


def _print(what: object) -> int:
    print(what)
    return 0
