"""What `embeddings` measured: each request, each run's summary, how close each target's vectors
are to transformers' own, and the report as JSON and Markdown."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.launcher import ProcessMemory
from bench.report import first_and_last, table
from bench.results import CpuInfo, PeerInfo
from bench.stats import percentile
from bench.summary import error_kind


@dataclass(frozen=True)
class EmbeddingPlan:
    """The workload every target gets: `num_inputs` texts of about `input_tokens` tokens per run,
    `batch` of them in each request, one closed-loop run per concurrency."""

    num_inputs: int = 256
    input_tokens: int = 200
    batch: int = 8
    concurrencies: tuple[int, ...] = (1, 4)
    warmup: int = 2  # requests sent first, not counted
    check: int = 8  # inputs whose vectors are held to transformers'
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if min(self.num_inputs, self.input_tokens, self.batch) < 1:
            raise ValueError("--num-inputs, --input-tokens and --batch must be >= 1")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError("every --concurrency must be >= 1")
        if self.warmup < 0 or self.check < 0:
            raise ValueError("--warmup and --check must be >= 0")


@dataclass(frozen=True)
class EmbedRequest:
    """One request's outcome; `start_s` from the start of its run, times in seconds."""

    index: int
    inputs: int
    tokens: int  # its inputs' tokens, as the benchmark's tokenizer counts them
    start_s: float
    latency_s: float | None = None
    usage_tokens: int | None = None  # usage.prompt_tokens, as the server counted them
    error: str = ""  # empty when the request succeeded

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class EmbedRun:
    """One target's run at one concurrency: every request, and how long the run took."""

    concurrency: int
    requests: tuple[EmbedRequest, ...]
    duration_s: float


@dataclass(frozen=True)
class RunSummary:
    """A run's throughput over its whole duration (completed requests only) and latencies."""

    concurrency: int
    sent: int
    completed: int
    failed: int
    inputs: int  # inputs of the completed requests
    inputs_per_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p90_s: float
    usage_tokens_per_input: float | None  # the server's count, where it reports one
    errors: dict[str, int]


def summarize_run(run: EmbedRun) -> RunSummary:
    """Inputs/s, prompt tokens/s, latency p50/p90 and the failures of `run`."""
    done = [r for r in run.requests if r.ok]
    inputs = sum(r.inputs for r in done)
    seconds = run.duration_s if run.duration_s > 0 else math.nan
    latencies = [r.latency_s for r in done if r.latency_s is not None]
    counted = [r for r in done if r.usage_tokens is not None]
    per_input = (sum(r.usage_tokens or 0 for r in counted) / sum(r.inputs for r in counted)
                 if counted else None)
    return RunSummary(
        run.concurrency, len(run.requests), len(done), len(run.requests) - len(done), inputs,
        inputs / seconds, sum(r.tokens for r in done) / seconds, percentile(latencies, 50),
        percentile(latencies, 90), per_input,
        dict(Counter(error_kind(r.error) for r in run.requests if not r.ok)))


@dataclass(frozen=True)
class Agreement:
    """Cosine similarity of a target's vectors with transformers' over the same `inputs` texts
    (NaN, with `error`, when they could not be compared)."""

    inputs: int
    mean_cosine: float
    min_cosine: float
    error: str = ""


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of the angle between `a` and `b`; ValueError for lengths that differ or a
    zero vector."""
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} values")
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    if norms == 0:
        raise ValueError("a zero vector has no direction")
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms


def agreement(vectors: Sequence[Sequence[float]],
              references: Sequence[Sequence[float]]) -> Agreement:
    """Mean and least cosine of each vector with its reference."""
    if len(vectors) != len(references):
        return failed_agreement(len(references), f"{len(vectors)} vectors for "
                                                 f"{len(references)} references")
    if not vectors:
        return failed_agreement(0, "nothing compared")
    try:
        cosines = [cosine(v, r) for v, r in zip(vectors, references, strict=True)]
    except ValueError as error:
        return failed_agreement(len(references), str(error))
    return Agreement(len(cosines), sum(cosines) / len(cosines), min(cosines))


def failed_agreement(inputs: int, why: str) -> Agreement:
    return Agreement(inputs, math.nan, math.nan, why)


@dataclass(frozen=True)
class EmbedTarget:
    """Every run against one server; `launch_flags` and `run_dir` only for ours."""

    label: str
    url: str
    model: str
    agreement: Agreement
    runs: tuple[EmbedRun, ...]
    launch_flags: tuple[str, ...] | None = None
    run_dir: str | None = None
    memory: dict[str, ProcessMemory] | None = None

    def summary_at(self, concurrency: int) -> RunSummary | None:
        run = next((r for r in self.runs if r.concurrency == concurrency), None)
        return None if run is None else summarize_run(run)


@dataclass(frozen=True)
class EmbeddingsResults:
    """An `embeddings` run: the plan, the CPU, how each peer ran, every target, the failures."""

    command: tuple[str, ...]
    plan: EmbeddingPlan
    cpu: CpuInfo
    cpus: str  # the CPUs every target ran on, such as "0-1"
    peers: dict[str, PeerInfo]  # target label -> how that peer was run
    targets: tuple[EmbedTarget, ...]
    failed: dict[str, str]  # target label -> why it could not be measured
    kernel_isa: dict[str, list[dict[str, str]]]  # our targets' label -> metric labels

    def reference(self) -> str | None:
        """The target every other's inputs/s is compared with: the first peer measured, else
        the first target."""
        labels = [t.label for t in self.targets]
        return next((label for label in labels if label in self.peers),
                    labels[0] if labels else None)

    def ratio(self, label: str, concurrency: int) -> float | None:
        """Inputs/s of `label` over the reference's at `concurrency` (None: either did not run
        there, or the reference completed nothing)."""
        reference = self.reference()
        mine, theirs = (self.summary(name, concurrency) for name in (label, reference))
        if mine is None or theirs is None or not theirs.inputs_per_s > 0:
            return None
        return mine.inputs_per_s / theirs.inputs_per_s

    def summary(self, label: str | None, concurrency: int) -> RunSummary | None:
        target = next((t for t in self.targets if t.label == label), None)
        return None if target is None else target.summary_at(concurrency)


# -- JSON ------------------------------------------------------------------------------------


def _target_json(results: EmbeddingsResults, target: EmbedTarget) -> dict[str, Any]:
    runs = [{"concurrency": run.concurrency, "duration_s": run.duration_s,
             "summary": summarize_run(run),
             "inputs_per_s_vs_reference": results.ratio(target.label, run.concurrency),
             "requests": run.requests} for run in target.runs]
    return {"label": target.label, "peer": target.label in results.peers, "url": target.url,
            "model": target.model, "launch_flags": target.launch_flags,
            "run_dir": target.run_dir, "memory_mb": target.memory,
            "kernel_isa": results.kernel_isa.get(target.label, []),
            "agreement": target.agreement, "runs": runs}


def embeddings_json(results: EmbeddingsResults) -> dict[str, Any]:
    """The whole report: command, plan, CPU, peers, failures, and per target its agreement
    with transformers and per run its summary and every request."""
    return {"benchmark": "embeddings", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": results.command, "plan": results.plan,
            "cpu": {"model": results.cpu.model, "flags": results.cpu.flags,
                    "cpus": results.cpus},
            "reference": results.reference(), "peers": results.peers,
            "failed": results.failed,
            "targets": [_target_json(results, t) for t in results.targets]}


# -- Markdown --------------------------------------------------------------------------------


def _across(target: EmbedTarget, levels: Sequence[int],
            pick: Callable[[RunSummary], str]) -> str:
    """One cell: `pick` of the run at each concurrency, joined by " / "."""
    summaries = (target.summary_at(c) for c in levels)
    return " / ".join("-" if s is None else pick(s) for s in summaries)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _agreement_cell(found: Agreement) -> str:
    if found.error or math.isnan(found.mean_cosine):
        return f"- ({found.error})" if found.error else "-"
    return f"{found.mean_cosine:.4f} / {found.min_cosine:.4f} ({found.inputs})"


def _row(results: EmbeddingsResults, target: EmbedTarget, levels: Sequence[int]) -> list[str]:
    return [
        target.label,
        _across(target, levels, lambda s: f"{s.inputs_per_s:.1f}"),
        _across(target, levels, lambda s: f"{s.tokens_per_s:.0f}"),
        _across(target, levels, lambda s: _ms(s.latency_p50_s)),
        _across(target, levels, lambda s: _ms(s.latency_p90_s)),
        _across(target, levels, lambda s: f"{s.completed}/{s.sent}"),
        " / ".join(_ratio(results.ratio(target.label, c)) for c in levels),
        _agreement_cell(target.agreement),
    ]


def concurrencies(results: EmbeddingsResults) -> tuple[int, ...]:
    """Every concurrency some target ran at, ascending."""
    return tuple(sorted({run.concurrency for t in results.targets for run in t.runs}))


def _peer_lines(results: EmbeddingsResults) -> list[str]:
    lines = []
    for label, info in results.peers.items():
        env = " ".join(f"{k}={v}" for k, v in info.env.items())
        lines.append(f"- {label}: {info.version}, serving {info.serves}: "
                     f"`{' '.join(info.command)}`" + (f" with {env}" if env else ""))
    return lines


def _failure_lines(results: EmbeddingsResults) -> list[str]:
    return [f"- {label} FAILED: {first_and_last(why)}" for label, why in results.failed.items()]


def embeddings_markdown(results: EmbeddingsResults) -> str:
    """The workload, the CPU, one row per target (each figure at every concurrency), how the
    peers ran and what failed."""
    plan, cpu = results.plan, results.cpu
    levels = concurrencies(results) or plan.concurrencies
    across = " / ".join(f"c={c}" for c in levels)
    header = [
        "target", f"inputs/s {across}", f"prompt tokens/s {across}",
        f"latency p50 (ms) {across}", f"latency p90 (ms) {across}",
        f"requests completed {across}", f"inputs/s vs {results.reference() or '-'} {across}",
        "cosine to transformers mean / min (inputs)"]
    rows = [_row(results, target, levels) for target in results.targets]
    title = (f"Embeddings side by side: {plan.num_inputs} texts of ~{plan.input_tokens} tokens "
             f"per run, {plan.batch} per request to /v1/embeddings (encoding_format float), "
             f"closed loop at concurrency {', '.join(map(str, plan.concurrencies))}")
    machine = (f"CPU: {cpu.model}, CPUs {results.cpus} for every target; "
               f"flags: {' '.join(cpu.simd()) or '-'}")
    note = (f"Cosine: each target's vectors of {plan.check} texts of their own (sent after "
            "the warm-up, before the runs) against transformers' final hidden state of the "
            "last token (fp32, after the model's last norm); a quantized GGUF scores lower.")
    tail = "\n".join(_peer_lines(results) + _failure_lines(results))
    parts = [title, machine, table(header, rows), note, tail]
    return "\n\n".join(part for part in parts if part)
