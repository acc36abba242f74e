"""`python -m bench calibrate`: fit a simulated model's profile (engine.sim.profile) to the
real runner's steps on this machine, and write it as YAML.

The runner is the one a worker of the model gets (`load_runner`: its dtype, kernels, quant
rows and threads here). Prefill steps of one prompt chunk over a grid of chunk lengths and
cached contexts, and decode steps over a grid of batch sizes and contexts, are timed (median of
`repeats`); prefill `a + b*tokens + c*tokens*context` and decode `d + e*batch + f*sum(context)`
are fitted to them by least squares on relative error with no negative term, and the fit's
error on every measured step is reported beside the profile.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from core.config import DecodeConfig, EngineConfig, ModelConfig
from engine.kernels.isa import cpu_summary
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner, load_runner
from engine.sim.profile import Latency, SimProfile, profile_path

BLOCK_SIZE = 16
PREFILL_TOKENS = (16, 64, 256, 512, 1024)
PREFILL_CONTEXTS = (0, 1024, 3072)
DECODE_BATCHES = (1, 4, 16, 32, 64)
DECODE_CONTEXTS = (128, 1024, 2048)
SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_size", "intermediate_size", "max_position_embeddings")


@dataclass(frozen=True)
class Step:
    """A timed step: its shape (tokens and keys for prefill, batch and contexts for decode)."""

    kind: str  # prefill | decode
    size: int  # new tokens, or sequences
    context: int  # cached tokens before it, each
    measured_ms: float

    def features(self) -> tuple[float, float, float]:
        """The model's terms: 1, tokens, token contexts (prefill); 1, batch, contexts."""
        if self.kind == "prefill":
            return 1.0, self.size, self.size * self.context + self.size * (self.size + 1) / 2
        return 1.0, self.size, self.size * (self.context + 1)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("calibrate", help="fit a sim profile to this machine's steps",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=ModelConfig().name)
    parser.add_argument("--name", default="default", help="the profile's name")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default 0: as a worker here, one per CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smaller grid (a check)")
    parser.add_argument("--out", type=Path, help="default: configs/sim/NAME.yaml")
    parser.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.repeats < 1 or args.threads < 0:
        raise ValueError("--repeats >= 1, --threads >= 0")
    out = args.out or profile_path(args.name)
    return lambda: calibrate(args.model, args.name, args.threads, args.repeats, args.quick, out)


def calibrate(model: str, name: str, threads: int, repeats: int, quick: bool, out: Path) -> int:
    grid = _grid(quick)
    longest = max(max(t + c for t, c in grid["prefill"]), max(c + 1 for _, c in grid["decode"]))
    blocks = max(max(b for b, _ in grid["decode"]) * -(-longest // BLOCK_SIZE), 64)
    pool = replace(DecodeConfig(), num_kv_blocks=blocks, block_size=BLOCK_SIZE, threads=threads)
    runner = load_runner(ModelConfig(name=model), pool, EngineConfig())
    assert isinstance(runner, ModelRunner), "a real model calibrates a profile"
    steps = _measure(runner, grid, repeats)
    profile = fit_profile(name, _source(runner, model), _shape(runner), steps,
                          str(runner.cache.dtype).removeprefix("torch."))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Written by `python -m bench calibrate --name {name}`; see "
                   f"docs/simulation.md.\n{profile.to_yaml()}")
    print(_report(profile, steps))
    print(f"wrote {out}")
    return 0


def fit_profile(name: str, source: str, shape: dict[str, int], steps: list[Step],
                dtype: str) -> SimProfile:
    """The profile whose latency fits `steps` best, with its fit's errors."""
    prefill = fit([s for s in steps if s.kind == "prefill"])
    decode = fit([s for s in steps if s.kind == "decode"])
    latency = Latency(*(float(f"{term:.4g}") for term in (*prefill, *decode)))
    errors = {f"{kind}_{stat}_pct": value for kind in ("prefill", "decode")
              for stat, value in _errors(latency, [s for s in steps if s.kind == kind]).items()}
    return SimProfile(name, source, shape, latency, dtype, fit_error=errors)


def fit(steps: list[Step]) -> tuple[float, float, float]:
    """The non-negative terms minimising the squared relative error over `steps`: every
    subset of terms fitted by least squares, the best with none negative kept."""
    features = torch.tensor([s.features() for s in steps], dtype=torch.float64)
    measured = torch.tensor([s.measured_ms for s in steps], dtype=torch.float64)
    weighted, target = features / measured[:, None], torch.ones_like(measured)
    best: tuple[float, list[float]] = (float("inf"), [0.0, 0.0, 0.0])
    for size in (1, 2, 3):
        for terms in itertools.combinations(range(3), size):
            solution = torch.linalg.lstsq(weighted[:, terms], target[:, None]).solution[:, 0]
            if (solution < 0).any():
                continue
            error = float(((weighted[:, terms] @ solution - target) ** 2).sum())
            if error < best[0]:
                coefficients = [0.0, 0.0, 0.0]
                for term, value in zip(terms, solution.tolist(), strict=True):
                    coefficients[term] = value
                best = (error, coefficients)
    a, b, c = best[1]
    return a, b, c


def _errors(latency: Latency, steps: list[Step]) -> dict[str, float]:
    errors = [abs(_predicted_ms(latency, s) / s.measured_ms - 1) * 100 for s in steps]
    return {"median": round(statistics.median(errors), 1), "max": round(max(errors), 1)}


def _predicted_ms(latency: Latency, step: Step) -> float:
    _, size, keys = step.features()
    if step.kind == "prefill":
        return latency.prefill_s(int(size), int(keys)) * 1e3
    return latency.decode_s(int(size), int(keys)) * 1e3


def _grid(quick: bool) -> dict[str, list[tuple[int, int]]]:
    prefill = PREFILL_TOKENS[1::2] if quick else PREFILL_TOKENS
    prefill_contexts = PREFILL_CONTEXTS[:2] if quick else PREFILL_CONTEXTS
    batches = DECODE_BATCHES[::2] if quick else DECODE_BATCHES
    contexts = DECODE_CONTEXTS[:2] if quick else DECODE_CONTEXTS
    return {"prefill": list(itertools.product(prefill, prefill_contexts)),
            "decode": list(itertools.product(batches, contexts))}


def _measure(runner: ModelRunner, grid: dict[str, list[tuple[int, int]]],
             repeats: int) -> list[Step]:
    points = [("prefill", *p) for p in grid["prefill"]] + [("decode", *p) for p in grid["decode"]]
    steps = []
    for kind, size, context in tqdm(points, desc="timing steps", unit="shape"):
        batch = _batch(runner, kind, size, context)
        runner.forward(batch)  # warm
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            runner.forward(batch)
            times.append((time.perf_counter() - began) * 1e3)
        steps.append(Step(kind, size, context, statistics.median(times)))
    return steps


def _batch(runner: ModelRunner, kind: str, size: int, context: int) -> ForwardBatch:
    """One chunk of `size` tokens after `context` cached ones, or `size` sequences of one new
    token after `context` each; each over blocks of its own (their KV's values do not change
    a step's time)."""
    sequences, new = (1, size) if kind == "prefill" else (size, 1)
    per_sequence = -(-(context + new) // BLOCK_SIZE)
    tables = [list(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(sequences)]
    assert sequences * per_sequence <= runner.allocator.num_total
    tokens = [[(7 * i + j) % 1000 + 100 for j in range(new)] for i in range(sequences)]
    return ForwardBatch(tokens, [context] * sequences, tables)


def _shape(runner: ModelRunner) -> dict[str, int]:
    spec = runner.spec
    return {"num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "max_position_embeddings": spec.max_position_embeddings}


def _source(runner: ModelRunner, model: str) -> str:
    return (f"{model}, {str(runner.cache.dtype).removeprefix('torch.')}, kernels "
            f"{runner.kernel_isa}, {torch.get_num_threads()} threads, on {cpu_summary()}, "
            f"{time.strftime('%Y-%m-%d')}: python -m bench calibrate")


def _report(profile: SimProfile, steps: list[Step]) -> str:
    lines = ["| step | size | context | measured ms | fitted ms | error |",
             "|---|---|---|---|---|---|"]
    for step in steps:
        predicted = _predicted_ms(profile.latency, step)
        lines.append(f"| {step.kind} | {step.size} | {step.context} | {step.measured_ms:.2f} | "
                     f"{predicted:.2f} | {(predicted / step.measured_ms - 1) * 100:+.0f}% |")
    return "\n".join([*lines, "", f"fit error: {profile.fit_error}", profile.to_yaml()])
