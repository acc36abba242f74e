"""The benchmark CLI: `python -m bench serve ...` and `python -m bench runner ...`.

    python -m bench serve --url http://127.0.0.1:8000 --workload chat --concurrency 8
    python -m bench serve --launch "p1d1=--prefill 1 --decode 1" --url vllm=http://host:8000 \\
        --workload mixed --rates 0.5,1,2 --slo-ttft 2 --slo-tpot 0.25 --out runs/cmp/results.json
    python -m bench runner --quick
    python -m bench attention --contexts 256x8,3400 --dtype bfloat16
    python -m bench prefill-attention --chunks 256@0,256@2816
    python -m bench quant --rows 1,4,8,16 --dtype bfloat16
    python -m bench fidelity --variant dense --variant quant --variant int8
    python -m bench transfer --tokens 512,2048,8192
    python -m bench handoff --input-len 512 --backends shm,zmq
    python -m bench overload --cap 16 --factor 10
    python -m bench prefix --prefix-len 1000
    python -m bench chats --launch "p1d1=--prefill 1 --decode 1" --chats 8 --turns 4
    python -m bench chunked --long-len 4000 --short-len 50
    python -m bench goodput --quick
    python -m bench peers --peer vllm --peer llamacpp --launch "p1d1=--prefill 1 --decode 1"
    python -m bench embeddings --peer vllm --peer llamacpp --launch "p1d1=--prefill 1 --decode 1"
    python -m bench gpu decode --model /tmp/raging-gpu-models/llama-1b-shape
    python -m bench calibrate --name default
    python -m bench trace write --workload chat --groups 8 --prefix-len 1000 --rate 20 \\
        --count 400 --out runs/trace.jsonl
    python -m bench policies --trace runs/trace.jsonl --prefill 2 --decode 6 --out runs/policies
    python -m bench scale streams relay workers
    python -m bench gguf write --shape 7b --out /tmp/random-7b.gguf
    python -m bench gguf measure --model /tmp/random-7b.gguf --weights quant
    python -m bench startup --launch "--prefill 1 --decode 1" --runs 3
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import get_args

import torch
from tqdm import tqdm

from bench import attention as decode_attention
from bench import calibrate as sim_profile
from bench import chats as chat_turns
from bench import chunked as chunked_prefill
from bench import embeddings as embedding_throughput
from bench import fidelity as greedy_fidelity
from bench import gguf as gguf_models
from bench import goodput as slo_goodput
from bench import gpu as on_gpu
from bench import handoff as kv_handoff
from bench import overload as flood
from bench import peers as side_by_side
from bench import policies as routing_policies
from bench import prefill_attention
from bench import prefix as prefix_cache
from bench import quant as quant_products
from bench import runner as microbench
from bench import scale as many_streams
from bench import startup as start_and_stop
from bench import trace as request_trace
from bench import transfer as kv_transfer
from bench.launcher import ROOT, redact
from bench.load import Load
from bench.plots import plot_serve
from bench.prompts import TokenPrompts
from bench.report import runner_json, runner_markdown, serve_json, serve_markdown, write_json
from bench.results import ServeResults
from bench.serve import Plan, Target, check_reachable, measure, prompt_maker
from bench.stats import Slo
from bench.workloads import WORKLOADS, Workload, build
from core.config import KV_BACKENDS, ModelConfig, QuantInputs
from engine.kernels.cpu.build import use_isa
from engine.kernels.isa import ISA_NAMES, cpu_name
from engine.locate import resolve_model
from engine.model.linear import measure_quant_rows
from engine.runner import set_threads, torch_dtype
from engine.weights.dtypes import DTYPE_NAMES


def numbers(kind: Callable[[str], float | int]) -> Callable[[str], tuple]:
    """An argparse type for comma-separated numbers such as `0.5,1,2`."""
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from error
    return parse


def default_out(name: str) -> Path:
    """runs/bench-<time>/<name> in the repository, beside launch.sh's logs (git-ignored)."""
    return ROOT / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}" / name


def _add_targets(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("servers (one or more, measured one after another)")
    group.add_argument("--url", action="append", default=[], metavar="[LABEL=]URL",
                       help="an OpenAI-compatible server, ours or another (repeatable)")
    group.add_argument("--launch", action="append", default=[], metavar='"[LABEL=]FLAGS"',
                       help='start ours with scripts/launch.sh FLAGS, e.g. "p1d2=--prefill 1 '
                            '--decode 2", measure it with its memory, stop it (repeatable)')
    group.add_argument("--model", help="model name to request (default: the server's first)")
    group.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' to every server; "
                                         "--launch servers are started with it as a key")
    group.add_argument("--tokenizer", type=Path,
                       help="tokenizer folder: exact prompt lengths as token ids (default: the "
                            "launched model's; without either, text of approximate length)")


def _add_workload(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (same requests for every server)")
    group.add_argument("--workload", choices=WORKLOADS, default="fixed")
    group.add_argument("--input-len", type=int, default=200, help="fixed: prompt tokens")
    group.add_argument("--output-len", type=int, default=64,
                       help="fixed, humaneval: output tokens (chat, mixed: lognormal)")
    group.add_argument("--long-share", type=float, default=0.07,
                       help="mixed: share of long (2,000-4,000 token) prompts")
    group.add_argument("--seed", type=int, default=0, help="seeds lengths and arrivals")


def _add_load(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load (default: --concurrency 1)")
    group.add_argument("--concurrency", type=int,
                       help="closed loop with N streams; with --rate(s), a cap on in-flight")
    group.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    group.add_argument("--rates", type=numbers(float), metavar="R1,R2,...",
                       help="sweep: one open-loop run per rate; reports the goodput rate")
    group.add_argument("--num-requests", type=int, default=64, help="measured per run")
    group.add_argument("--duration", type=float, help="seconds after which no request starts")
    group.add_argument("--warmup", type=int, default=1, help="requests sent first, not counted")
    group.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    group.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (default 2)")
    group.add_argument("--slo-tpot", type=float, default=0.25, help="seconds (default 0.25)")


def serve_parser(commands: argparse._SubParsersAction) -> None:
    """The `serve` subcommand's flags."""
    parser = commands.add_parser("serve", help="measure OpenAI-compatible servers",
                                 description="Stream a workload through /v1/completions of "
                                             "each server and measure it from the SSE stream.")
    _add_targets(parser)
    _add_workload(parser)
    _add_load(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (the PNG goes next to it; default runs/bench-TIME/)")
    parser.set_defaults(prepare=prepare_serve)


def loads(args: argparse.Namespace) -> tuple[Load, ...]:
    """The runs each server gets: one per swept rate, else one."""
    if args.rate is not None and args.rates:
        raise ValueError("give --rate or --rates, not both")
    rates = args.rates or (args.rate,)
    closed = args.concurrency is None and not any(rates)
    concurrency = 1 if closed else args.concurrency
    return tuple(Load(concurrency=concurrency, rate=rate, duration_s=args.duration,
                      request_timeout_s=args.request_timeout, seed=args.seed)
                 for rate in rates)


def serve_plan(args: argparse.Namespace, targets: list[Target]) -> tuple[Plan, Workload, str]:
    """The requests and loads every target gets, and how the prompts were made."""
    if args.num_requests < 1 or args.warmup < 0:
        raise ValueError("--num-requests must be >= 1 and --warmup >= 0")
    workload = Workload(args.workload, args.input_len, args.output_len, args.long_share,
                        args.seed)
    prompts, how = prompt_maker(args.tokenizer, targets)
    specs = build(workload, prompts, args.warmup + args.num_requests)
    plan = Plan(tuple(specs[:args.warmup]), tuple(specs[args.warmup:]), loads(args),
                Slo(args.slo_ttft, args.slo_tpot), args.model, args.api_key)
    return plan, workload, how


def prepare_serve(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    """Check the flags and build the requests; the returned job measures every target."""
    targets = [Target.from_url(url) for url in args.url]
    targets += [Target.from_launch(text) for text in args.launch]
    if not targets:
        raise ValueError("give at least one --url or --launch")
    for target in targets:
        check_reachable(target, args.api_key)
    plan, workload, how = serve_plan(args, targets)
    out = args.out or default_out("results.json")
    return lambda: run_serve(targets, plan, ServeResults(
        ("python -m bench", *redact(argv)), workload, how, len(plan.requests), len(plan.warmup),
        plan.slo, bool(args.rates), ()), out)


def run_serve(targets: list[Target], plan: Plan, settings: ServeResults, out: Path) -> int:
    """Measure every target; write JSON and PNG; print the Markdown table.

    Exit status 1 when some server completed no request at all.
    """
    measured = tuple(measure(target, plan) for target in targets)
    results = dataclasses.replace(settings, targets=measured)
    write_json(serve_json(results), out)
    plot_serve(results, out.with_suffix(".png"))
    print(serve_markdown(results))
    print(f"\nwrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return int(any(m.summary.completed == 0 for t in measured for m in t.runs))


def runner_parser(commands: argparse._SubParsersAction) -> None:
    """The `runner` subcommand's flags."""
    defaults = microbench.RunnerPlan()
    parser = commands.add_parser("runner", help="bare forward pass: ours vs transformers",
                                 description="Time the bare batched forward pass of our "
                                             "runner and of transformers on the same weights.")
    parser.add_argument("--model", default=ModelConfig().name, help="model name or folder")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{microbench.QUICK.repeats} prefill run and "
                             f"{microbench.QUICK.steps} decode steps per figure")
    parser.add_argument("--prefill-lens", type=numbers(int), default=defaults.prefill_lens,
                        metavar="N1,N2,...", help="prompt lengths timed at batch 1")
    parser.add_argument("--batch-sizes", type=numbers(int), default=defaults.batch_sizes,
                        metavar="B1,B2,...", help="decode batch sizes timed")
    parser.add_argument("--context", type=int, default=defaults.context,
                        help="tokens cached per sequence before the timed decode steps")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=defaults.dtype,
                        help="weights, activations and KV of both sides (default: %(default)s)")
    parser.add_argument("--quant-rows", type=int, default=defaults.quant_rows,
                        help="ours: products of at most this many rows read the GGUF's "
                             "quant blocks (-1: as many as is faster, measured; 0: never)")
    parser.add_argument("--out", type=Path, help="results JSON (default runs/bench-TIME/)")
    parser.set_defaults(prepare=prepare_runner)


def prepare_runner(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    """Check the flags and set the threads; the returned job runs the microbenchmark."""
    set_threads(args.threads)
    base = microbench.QUICK if args.quick else microbench.RunnerPlan()
    plan = dataclasses.replace(base, prefill_lens=args.prefill_lens,
                               batch_sizes=args.batch_sizes, context=args.context,
                               dtype=args.dtype, quant_rows=args.quant_rows)
    folder = resolve_model(args.model, ModelConfig().cache_dir)
    return lambda: run_runner(folder, plan, args.out or default_out("runner.json"))


def run_runner(folder: Path, plan: microbench.RunnerPlan, out: Path) -> int:
    """Time both forward passes; write JSON; print the Markdown table."""
    prompts = TokenPrompts(folder)
    with tqdm(total=2 * (len(plan.prefill_lens) + len(plan.batch_sizes)), desc="runner") as bar:
        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()
        results = microbench.run(folder, plan, lambda n: prompts.prompt(0, n), progress)
    write_json(runner_json(results), out)
    print(runner_markdown(results))
    print(f"\nwrote {out} (torch {torch.__version__})", file=sys.stderr)
    return 0


def attention_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench attention`: decode attention, C++ kernel against gather + SDPA."""
    parser = commands.add_parser("attention", help="decode attention: kernel vs gather+SDPA",
                                 description=decode_attention.__doc__)
    parser.add_argument("--contexts", type=lambda text: text.split(","),
                        default=decode_attention.DEFAULT_CONTEXTS.split(","),
                        help="batches, comma-separated, each LENxCOUNT terms joined by +")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the cache's; auto: what model.dtype auto serves on this CPU")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.set_defaults(prepare=prepare_attention)


def prepare_attention(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    for spec in args.contexts:
        decode_attention.parse_contexts(spec)
    set_threads(args.threads)

    def job() -> int:
        figures = decode_attention.measure(args.contexts, cache_dtype(args.dtype), args.repeats)
        print(decode_attention.markdown(figures))
        return 0
    return job


def cache_dtype(name: str) -> torch.dtype:
    """The attention benchmarks' cache dtype (`auto` resolved as a worker would), said."""
    dtype = torch_dtype(name)
    print(f"cache: {str(dtype).removeprefix('torch.')}", flush=True)
    return dtype


def prefill_attention_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench prefill-attention`: a prompt chunk's attention, kernel vs gather+SDPA."""
    parser = commands.add_parser("prefill-attention",
                                 help="prefill attention: kernel vs gather+SDPA",
                                 description=prefill_attention.__doc__)
    parser.add_argument("--chunks", type=lambda text: text.split(","),
                        default=prefill_attention.DEFAULT_CHUNKS.split(","),
                        help="chunks, comma-separated, each NEW@CACHED tokens")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the cache's; auto: what model.dtype auto serves on this CPU")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.set_defaults(prepare=prepare_prefill_attention)


def prepare_prefill_attention(args: argparse.Namespace, argv: Sequence[str]
                              ) -> Callable[[], int]:
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    for spec in args.chunks:
        prefill_attention.parse_chunk(spec)
    set_threads(args.threads)

    def job() -> int:
        figures = prefill_attention.measure(args.chunks, args.repeats,
                                            dtype=cache_dtype(args.dtype))
        print(prefill_attention.markdown(figures))
        return 0
    return job


def _add_model_flags(parser: argparse.ArgumentParser, dtype: str, threads: int | None) -> None:
    """--model, --dtype and --threads of the benchmarks that load the real model in-process."""
    parser.add_argument("--model", default=ModelConfig().name, help="model name or folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=dtype)
    parser.add_argument("--threads", type=int, default=threads, help="torch threads")


def quant_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench quant`: weight products over the GGUF's quant blocks against dense."""
    parser = commands.add_parser("quant", help="weight products: quant blocks vs dense",
                                 description=quant_products.__doc__)
    _add_model_flags(parser, dtype="bfloat16", threads=1)
    parser.add_argument("--rows", type=numbers(int), default=quant_products.DEFAULT_ROWS,
                        metavar="R1,R2,...", help="input rows (sequences in a decode step)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inputs", choices=get_args(QuantInputs), default="exact",
                        help="what the quant products multiply (model.quant_inputs)")
    parser.set_defaults(prepare=prepare_quant)


def prepare_quant(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.repeats < 1 or min(args.rows) < 1:
        raise ValueError("--repeats and every --rows must be >= 1")
    set_threads(args.threads)
    dtype = torch_dtype(args.dtype)

    def job() -> int:
        matrices = quant_products.load_matrices(args.model, ModelConfig().cache_dir, dtype,
                                                args.inputs)
        figures = quant_products.measure(matrices, dtype, args.rows, args.repeats)
        measured = measure_quant_rows(matrices, dtype)
        size = quant_products.quant_bytes(matrices)
        read = quant_products.memory_read_gbps(size, args.repeats)
        print(quant_products.markdown(figures, args.dtype, args.threads, args.inputs, measured,
                                      size, read))
        return 0
    return job


def fidelity_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench fidelity`: our greedy tokens against transformers', per variant."""
    parser = commands.add_parser("fidelity", help="greedy tokens against transformers'",
                                 description=greedy_fidelity.__doc__)
    _add_model_flags(parser, dtype="float32", threads=None)
    parser.add_argument("--variant", action="append", choices=sorted(greedy_fidelity.VARIANTS),
                        help="how the products run (repeatable; default: all)")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer tokens per question")
    parser.set_defaults(prepare=prepare_fidelity)


def prepare_fidelity(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    set_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    variants = args.variant or list(greedy_fidelity.VARIANTS)

    def job() -> int:
        folder = resolve_model(args.model, ModelConfig().cache_dir)
        gguf = Path(args.model) if args.model.endswith(".gguf") else None
        answers = greedy_fidelity.reference_answers(folder, dtype, args.max_tokens, gguf=gguf)
        verdicts = {variant: greedy_fidelity.measure(folder, dtype, answers, variant)
                    for variant in tqdm(variants, desc="variants", unit="variant")}
        print(greedy_fidelity.markdown(verdicts, args.dtype, args.max_tokens))
        return 0
    return job


def transfer_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench transfer`: KV hand-off GB/s per backend against memcpy."""
    parser = commands.add_parser("transfer", help="KV transfer GB/s per backend vs memcpy",
                                 description=kv_transfer.__doc__)
    parser.add_argument("--tokens", type=numbers(int), default=(512, 2048, 8192),
                        help="KV sizes in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--curve", action="store_true",
                        help="over CURVE-authenticated, encrypted sockets (as launch.sh runs)")
    parser.add_argument("--backends", type=lambda text: tuple(text.split(",")), default=(),
                        help="only these backends, comma-separated (zmq, shm, cuda_ipc; "
                             "default: every one this host runs)")
    parser.set_defaults(prepare=prepare_transfer)


def prepare_transfer(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.repeats < 1 or not args.tokens or min(args.tokens) < 1:
        raise ValueError("--repeats and every --tokens entry must be >= 1")

    def job() -> int:
        figures = kv_transfer.measure(args.tokens, args.repeats, curve=args.curve,
                                      only=args.backends)
        print(kv_transfer.markdown(figures))
        return 0
    return job


def handoff_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench handoff`: TTFT of disaggregation against one process."""
    parser = commands.add_parser("handoff", help="TTFT: prefill+decode vs one process",
                                 description=kv_handoff.__doc__)
    parser.add_argument("--model", default=ModelConfig().name, help="model name or folder")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--backends", type=lambda text: tuple(text.split(",")),
                        default=("shm", "zmq"), help="KV backends, comma-separated")
    parser.set_defaults(prepare=prepare_handoff)


def prepare_handoff(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.repeats < 1 or args.input_len < 1:
        raise ValueError("--repeats and --input-len must be >= 1")
    unknown = set(args.backends) - set(KV_BACKENDS)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}; choose from {KV_BACKENDS}")
    folder = resolve_model(args.model, ModelConfig().cache_dir)
    return lambda: kv_handoff.run(folder, args.input_len, args.repeats, args.backends)


def overload_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench overload`: admitted requests' latency under a flood."""
    parser = commands.add_parser("overload", help="admission control under a flood",
                                 description=flood.__doc__)
    parser.add_argument("--launch", default="--prefill 1 --decode 1",
                        help="launch.sh flags of the server (default: %(default)s)")
    parser.add_argument("--cap", type=int, default=16,
                        help="gateway.max_inflight_requests (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--idle-requests", type=int, default=8)
    parser.add_argument("--rated-requests", type=int, default=96)
    parser.add_argument("--factor", type=float, default=10.0,
                        help="flood arrival rate in multiples of the rated throughput")
    parser.add_argument("--flood-seconds", type=float, default=40.0)
    parser.add_argument("--out", type=Path, help="results JSON (default runs/bench-TIME/)")
    parser.set_defaults(prepare=prepare_overload)


def prepare_overload(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if min(args.cap, args.input_len, args.output_len, args.rated_requests) < 1 \
            or args.factor <= 0 or args.flood_seconds <= 0 or args.idle_requests < 1:
        raise ValueError("counts, lengths, --factor and --flood-seconds must be positive")
    plan = flood.OverloadPlan(tuple(shlex.split(args.launch)), args.cap, args.input_len,
                              args.output_len, args.idle_requests, args.rated_requests,
                              args.factor, args.flood_seconds)
    out = args.out or default_out("overload.json")

    def job() -> int:
        phases = flood.run(plan, out.with_name("overload-config.yaml"))
        write_json(flood.as_json(plan, phases), out)
        print(flood.markdown(phases))
        print(f"\nwrote {out}", file=sys.stderr)
        return 0
    return job


def prefix_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench prefix`: TTFT with a cached prompt prefix against cold."""
    parser = commands.add_parser("prefix", help="TTFT: prefix cached vs cold",
                                 description=prefix_cache.__doc__)
    parser.add_argument("--launch", default="--prefill 1 --decode 1",
                        help="launch.sh flags of the server (default: %(default)s)")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8)
    parser.set_defaults(prepare=prepare_prefix)


def prepare_prefix(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if min(args.prefix_len, args.suffix_len, args.output_len, args.pairs) < 1:
        raise ValueError("--prefix-len, --suffix-len, --output-len and --pairs must be >= 1")
    plan = prefix_cache.PrefixPlan(tuple(shlex.split(args.launch)), args.prefix_len,
                                   args.suffix_len, args.output_len, args.pairs)

    def job() -> int:
        print(prefix_cache.markdown(plan, prefix_cache.run(plan)))
        return 0
    return job


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: the command line) and run the chosen subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--isa", choices=("auto", *ISA_NAMES), default="auto",
                        help="the kernels' instruction set in this process's benchmarks "
                             "(servers: --launch '... --set engine.isa=LEVEL')")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser(commands)
    runner_parser(commands)
    attention_parser(commands)
    prefill_attention_parser(commands)
    quant_parser(commands)
    fidelity_parser(commands)
    transfer_parser(commands)
    handoff_parser(commands)
    overload_parser(commands)
    prefix_parser(commands)
    slo_goodput.add_parser(commands)
    chat_turns.add_parser(commands)
    chunked_prefill.add_parser(commands)
    side_by_side.add_parser(commands)
    embedding_throughput.add_parser(commands)
    on_gpu.add_parser(commands)
    sim_profile.add_parser(commands)
    request_trace.add_parser(commands)
    routing_policies.add_parser(commands)
    many_streams.add_parser(commands)
    gguf_models.add_parser(commands)
    start_and_stop.add_parser(commands)
    args = parser.parse_args(argv)
    try:
        level = use_isa(args.isa)
        print(f"kernels: {level.name} ({cpu_name() or 'unknown CPU'})", file=sys.stderr)
        job = args.prepare(args, argv)
    except ValueError as error:  # flags that parse but do not make sense together
        parser.error(str(error))
    return int(job())


if __name__ == "__main__":
    sys.exit(main())
