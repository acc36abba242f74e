"""GGUF files read directly, and the copies of the weights a worker multiplies.

    python -m bench gguf write --shape 7b --out /tmp/random-7b.gguf
    python -m bench gguf write --shape 1b --mix q4_k_m --out /tmp/random-1b-q4_k_m.gguf
    python -m bench gguf measure --model /tmp/random-7b.gguf --weights quant
    python -m bench gguf serve --model /tmp/random-7b.gguf

`write` writes a Llama of a named shape with random weights in quant blocks (`--mix`: Q4_1 with
the embedding in Q8_0, as llama.cpp's Q4_K_M, or every type raging keeps a different way), with
SmolLM2's tokenizer and chat template, by the `gguf` package: the bytes of each quant block are
drawn directly, so a 7B file takes seconds and no dense copy ever exists.
`measure` loads the model once per `--weights` choice (engine.weights.choice), each in a fresh
process, and reports that process's memory (from /proc/self/smaps_rollup: its own, and mapped
from files, which workers on a host share) and the time of a prompt chunk and of decode steps.
`serve` runs launch.sh on the model, streams one chat completion, and reports its first token's
time, its tokens and every process's memory (PSS: shared pages split among their users).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from functools import cache, partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize
from tqdm import tqdm

from bench.launcher import launched, memory
from bench.report import write_json
from core.config import ModelConfig
from engine.locate import resolve_model
from engine.weights.folder import DEFAULT_MODEL, packaged_gguf
from engine.weights.gguf import ROPE_FACTORS
from engine.weights.rope_scaling import llama3_frequencies
from engine.weights.spec import SUPPORTED_MODEL_TYPES

# Llama shapes, with SmolLM2's vocabulary (its tokenizer is the one written)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2},
    # Qwen3-0.6B's layers (with --architecture qwen3: its heads of 128)
    "0.6b": {"hidden": 1024, "intermediate": 3072, "layers": 28, "heads": 16, "kv_heads": 8},
    # the smallest whose rows split into 256-value K-quant blocks
    "small": {"hidden": 256, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 2},
    "1b": {"hidden": 2048, "intermediate": 8192, "layers": 16, "heads": 32, "kv_heads": 8},
    "3b": {"hidden": 3072, "intermediate": 8192, "layers": 28, "heads": 24, "kv_heads": 8},
    "7b": {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8},
}
WEIGHT_SCALE = 0.02  # standard deviation of the random weights
QWEN3_HEAD_DIM = 128  # every Qwen3's (transformers reads no head width from a GGUF)
ROPE_THETA = 10000.0
Kind = GGMLQuantizationType
# the quant type of each matrix of a random model: by GGUF name part, else "matrices"
MIXES: dict[str, dict[str, Kind]] = {
    "q4_1": {"token_embd": Kind.Q8_0, "output": Kind.Q8_0, "matrices": Kind.Q4_1},
    # as llama.cpp's Q4_K_M, but with Q6_K in every layer's v and down matrices, not half
    "q4_k_m": {"token_embd": Kind.Q4_K, "output": Kind.Q6_K, "attn_v": Kind.Q6_K,
               "ffn_down": Kind.Q6_K, "matrices": Kind.Q4_K},
    # one type per matrix, each way engine.weights.gguf_blocks keeps one (columns: x256)
    "every": {"token_embd": Kind.Q2_K, "output": Kind.IQ4_NL, "attn_q": Kind.Q4_0,
              "attn_k": Kind.Q5_0, "attn_v": Kind.Q5_1, "attn_output": Kind.Q4_K,
              "ffn_gate": Kind.Q5_K, "ffn_up": Kind.Q3_K, "ffn_down": Kind.Q6_K,
              "matrices": Kind.Q8_0},
}
_TOKENS, _TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
_MERGES = "tokenizer.ggml.merges"
TokenizerField = tuple[Any, GGUFValueType, GGUFValueType | None]  # value, type, array type
# where a block's fp16 scale and (for types with one) its fp16 min are, in bytes
_SCALE_BYTES: dict[Kind, tuple[int, int | None]] = {
    Kind.Q4_0: (0, None), Kind.Q4_1: (0, 2), Kind.Q5_0: (0, None), Kind.Q5_1: (0, 2),
    Kind.Q8_0: (0, None), Kind.Q2_K: (80, 82), Kind.Q3_K: (108, None), Kind.Q4_K: (0, 2),
    Kind.Q5_K: (0, 2), Kind.Q6_K: (208, None), Kind.IQ4_NL: (0, None), Kind.IQ4_XS: (0, None),
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("gguf", help="random GGUF models; memory and speed per "
                                 "copy of the weights", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True)
    write = actions.add_parser("write", help="a random model of a named shape as a GGUF")
    write.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    write.add_argument("--mix", choices=sorted(MIXES), default="q4_1",
                       help="quant types of the matrices (q4_k_m: as llama.cpp's Q4_K_M)")
    write.add_argument("--architecture", choices=SUPPORTED_MODEL_TYPES, default="llama")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--out", type=Path, required=True)
    write.set_defaults(prepare=lambda args, argv: lambda: _write(args))
    measure = actions.add_parser("measure", help="memory and step times per --weights")
    measure.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file, or a model")
    measure.add_argument("--weights", default="quant,dense",
                         help="comma-separated model.weights choices, each in its own process")
    measure.add_argument("--dtype", default="auto")
    measure.add_argument("--tp", type=int, default=1, help="processes the model is split over")
    measure.add_argument("--threads", type=int, default=0,
                         help="torch threads of each process (0: one per CPU here)")
    measure.add_argument("--chunk", type=int, default=256, help="prompt chunk tokens")
    measure.add_argument("--batches", default="1,16", help="decode batch sizes")
    measure.add_argument("--out", type=Path)
    measure.set_defaults(prepare=lambda args, argv: lambda: _measure_all(args))
    serve = actions.add_parser("serve", help="launch.sh on a model: a streamed chat, memory")
    serve.add_argument("--model", required=True, help="a GGUF file, or a model")
    serve.add_argument("--prefill", type=int, default=1)
    serve.add_argument("--decode", type=int, default=1)
    serve.add_argument("--max-tokens", type=int, default=16)
    serve.add_argument("--out", type=Path)
    serve.set_defaults(prepare=lambda args, argv: lambda: _serve(args))


def _write(args: argparse.Namespace) -> int:
    write_random_gguf(args.out, SHAPES[args.shape], seed=args.seed, mix=args.mix,
                      architecture=args.architecture)
    print(args.out)
    return 0


def write_random_gguf(path: Path, shape: dict[str, int], seed: int = 0, mix: str = "q4_1",
                      scale: float = WEIGHT_SCALE, architecture: str = "llama",
                      llama3_rope: dict[str, Any] | None = None, vocab: int | None = None
                      ) -> None:
    """A Llama-family model of `shape` with random weights of deviation `scale`: its matrices
    in the quant types of `mix` (`MIXES`), its norms ones; SmolLM2's tokenizer. A "qwen2" has
    biases on q, k and v and an output matrix of its own; a "qwen3" q and k norms (drawn
    around one), heads of 128 as every Qwen3 has, and an output matrix; a "llama" and a
    "mistral" share the embedding. `llama3_rope`: Llama 3's rope scaling, written as
    llama.cpp's converter writes it (a divisor per frequency, `rope_freqs.weight`). `vocab`:
    the tokenizer cut to its first `vocab` tokens and the merges among them, for a file that
    transformers and a preparation read in a fraction of the seconds the whole one takes."""
    tokenizer = tokenizer_fields(vocab)
    writer = GGUFWriter(path, architecture)
    head_dim = QWEN3_HEAD_DIM if architecture == "qwen3" else shape["hidden"] // shape["heads"]
    vocab = len(tokenizer[_TOKENS][0])
    _add_metadata(writer, shape, vocab, tokenizer, head_dim)
    tensors = list(_tensor_plan(shape, vocab, MIXES[mix], architecture, head_dim))
    if llama3_rope is not None:
        tensors.append((ROPE_FACTORS, head_dim // 2, 1, None))
    for name, rows, columns, kind in tensors:
        if kind is None:
            writer.add_tensor_info(name, [rows], np.dtype(np.float32), rows * 4)
        else:
            nbytes = rows * quant_row_bytes(kind, columns)
            writer.add_tensor_info(name, [rows, nbytes // rows], np.dtype(np.uint8), nbytes,
                                   kind)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, rows, columns, kind in tqdm(tensors, desc=f"writing {path.name}", unit="tensor"):
        if kind is not None:
            writer.write_tensor_data(random_blocks(rng, kind, rows, columns, scale))
        elif name == ROPE_FACTORS:
            assert llama3_rope is not None
            plain = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2).double() / head_dim)
            writer.write_tensor_data(
                (plain / llama3_frequencies(plain, llama3_rope)).float().numpy())
        elif name.endswith(".bias"):  # drawn large enough to count
            writer.write_tensor_data(rng.normal(0, 0.5, rows).astype(np.float32))
        elif name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):  # drawn as well
            writer.write_tensor_data(rng.normal(1, 0.5, rows).astype(np.float32))
        else:
            writer.write_tensor_data(np.ones(rows, np.float32))
    writer.close()


def _tensor_plan(shape: dict[str, int], vocab: int, mix: dict[str, Kind], architecture: str,
                 head_dim: int) -> Iterator[tuple[str, int, int, Kind | None]]:
    """(GGUF name, rows, columns, quant type or None for an fp32 vector) of every tensor;
    a qwen2's q/k/v biases, a qwen3's q and k norms, and an output matrix for both."""
    hidden, q, kv = shape["hidden"], shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    yield "token_embd.weight", vocab, hidden, mix["token_embd"]
    if architecture in ("qwen2", "qwen3"):
        yield "output.weight", vocab, hidden, mix["output"]
    yield "output_norm.weight", hidden, 1, None
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}."
        yield prefix + "attn_norm.weight", hidden, 1, None
        yield prefix + "ffn_norm.weight", hidden, 1, None
        if architecture == "qwen3":
            yield prefix + "attn_q_norm.weight", head_dim, 1, None
            yield prefix + "attn_k_norm.weight", head_dim, 1, None
        for part, rows, columns in (("attn_q", q, hidden), ("attn_k", kv, hidden),
                                    ("attn_v", kv, hidden), ("attn_output", hidden, q),
                                    ("ffn_gate", shape["intermediate"], hidden),
                                    ("ffn_up", shape["intermediate"], hidden),
                                    ("ffn_down", hidden, shape["intermediate"])):
            yield prefix + part + ".weight", rows, columns, mix.get(part, mix["matrices"])
            if architecture == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                yield prefix + part + ".bias", rows, 1, None


def quant_row_bytes(kind: Kind, columns: int) -> int:
    values, nbytes = GGML_QUANT_SIZES[kind]
    assert columns % values == 0, f"{columns} columns do not split into {kind.name} blocks"
    return columns // values * nbytes


def random_blocks(rng: np.random.Generator, kind: Kind, rows: int, columns: int,
                  deviation: float) -> np.ndarray:
    """Random quant blocks `[rows, bytes]` of type `kind`, of values with about this
    `deviation`, centred: random bytes, with each block's fp16 scale (and min) set."""
    values, nbytes = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows * columns // values, nbytes), dtype=np.uint8)
    unit, centring = _calibration(kind)
    scale = (deviation / unit * rng.uniform(0.5, 1.5, (data.shape[0], 1))).astype(np.float32)
    _set_scales(data, kind, scale, centring * scale)
    return data.reshape(rows, -1)


def _set_scales(blocks: np.ndarray, kind: Kind, scale: np.ndarray, low: np.ndarray) -> None:
    scale_at, low_at = _SCALE_BYTES[kind]
    blocks[:, scale_at:scale_at + 2] = scale.astype(np.float16).view(np.uint8)
    if low_at is not None:
        blocks[:, low_at:low_at + 2] = low.astype(np.float16).view(np.uint8)


@cache
def _calibration(kind: Kind) -> tuple[float, float]:
    """For random blocks of `kind`: the deviation of their values at scale 1, and the min (in
    scales) that centres them, measured on a sample."""
    sample = np.random.default_rng(0).integers(0, 256, (512, GGML_QUANT_SIZES[kind][1]),
                                               dtype=np.uint8)
    ones, zeros = np.ones((512, 1), np.float32), np.zeros((512, 1), np.float32)
    _set_scales(sample, kind, ones, zeros)
    scaled = dequantize(sample, kind)
    centring = 0.0
    if _SCALE_BYTES[kind][1] is not None:
        _set_scales(sample, kind, zeros, ones)
        centring = -float(scaled.mean() / dequantize(sample, kind).mean())
        _set_scales(sample, kind, ones, centring * ones)
        scaled = dequantize(sample, kind)
    return float(scaled.std()), centring


def _add_metadata(writer: GGUFWriter, shape: dict[str, int], vocab: int,
                  tokenizer: dict[str, TokenizerField], head_dim: int) -> None:
    writer.add_name(f"random {writer.arch} {shape['layers']}x{shape['hidden']}")
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_block_count(shape["layers"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key, (value, value_type, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, value_type, sub_type)


@cache
def tokenizer_fields(vocab: int | None = None) -> dict[str, TokenizerField]:
    """SmolLM2's tokenizer as the packaged GGUF holds it (key -> value, type, array type),
    or cut to its first `vocab` tokens: their types, and the merges of two of them into a
    third (a byte-level BPE of its own; SmolLM2's special tokens and bytes come first)."""
    reader = GGUFReader(packaged_gguf(DEFAULT_MODEL))
    fields = {key: (field.contents(), field.types[0],
                    field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None)
              for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    if vocab is None:
        return fields
    tokens = fields[_TOKENS][0][:vocab]
    kept = set(tokens)
    merges = [merge for merge in fields[_MERGES][0]
              if all(part in kept for part in (*merge.split(" "), merge.replace(" ", "")))]
    cut = {_TOKENS: tokens, _TOKEN_TYPES: fields[_TOKEN_TYPES][0][:vocab], _MERGES: merges}
    return {key: (cut.get(key, value), value_type, sub_type)
            for key, (value, value_type, sub_type) in fields.items()}


def _measure_all(args: argparse.Namespace) -> int:
    resolve_model(args.model, ModelConfig().cache_dir)  # prepared before, not in, a measurement
    results = []
    for weights in args.weights.split(","):
        command = [sys.executable, "-c", _CHILD, args.model, weights, args.dtype,
                   str(args.chunk), args.batches, str(args.tp), str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    if args.out:
        write_json({"model": args.model, "results": results}, args.out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode),
             "--model", str(args.model)]
    with launched(flags) as server:
        result = stream_chat(server.url, args.max_tokens)
        result["memory_mb"] = {name: asdict(usage)
                               for name, usage in memory(server.run_dir).items()}
    print(json.dumps(result))
    if args.out:
        write_json({"model": str(args.model), "flags": flags, **result}, args.out)
    return 0


def stream_chat(url: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: seconds to its first token and to its end, its tokens."""
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Write a haiku about memory maps."}],
                "stream_options": {"include_usage": True}}
        start, first = time.perf_counter(), None
        usage: dict[str, Any] = {}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                deltas = [c["delta"].get("content") for c in chunk.get("choices", [])]
                if first is None and any(deltas):
                    first = time.perf_counter() - start
        return {"served_as": model, "first_token_s": round(first or -1, 2),
                "total_s": round(time.perf_counter() - start, 2), "usage": usage}


def measure_one(model: str, weights: str, dtype: str, chunk: int, batches: Sequence[int],
                tp: int = 1, threads: int = 0) -> dict[str, Any]:
    """Load `model` with `weights` (split over `tp` processes, this one rank 0), and time a
    chunk and decode steps. Memory is this process's."""
    import torch

    from core.config import DecodeConfig
    from engine.model.batch import ForwardBatch
    from engine.runner import load_runner

    batch_max = max(batches)
    context = chunk + 8
    blocks_each = -(-context // 16)
    pool = DecodeConfig(num_kv_blocks=blocks_each * batch_max + 1, block_size=16, tp=tp,
                        threads=threads)
    start = time.perf_counter()
    runner = load_runner(ModelConfig(name=model, weights=weights, dtype=dtype), pool)  # type: ignore[arg-type]
    loaded = time.perf_counter() - start
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch_max)]
    chunk_ms = _best_ms(lambda: runner.forward(ForwardBatch([[7] * chunk], [0], tables[:1])))
    steps = {}
    for size in batches:
        step = ForwardBatch([[7]] * size, [chunk] * size, tables[:size])
        steps[str(size)] = round(_best_ms(partial(runner.forward, step)), 2)
    return {"weights": weights, "tp": tp, "threads": torch.get_num_threads(),
            "dtype": str(runner.cache.dtype), "load_s": round(loaded, 1),
            "chunk_tokens": chunk, "chunk_ms": round(chunk_ms, 1), "decode_step_ms": steps,
            **memory_mb()}


def memory_mb() -> dict[str, float]:
    """This process's memory in MB: resident; its own (anonymous: no other process can share
    it); mapped from files (shareable: every worker mapping the same file shares one copy)."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        fields[key] = int(value.split()[0]) / 1024
    return {"rss_mb": round(fields["Rss"]), "own_mb": round(fields["Anonymous"]),
            "file_mb": round(fields["Rss"] - fields["Anonymous"])}


def _best_ms(step: Callable[[], object], runs: int = 3) -> float:
    step()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1000


_CHILD = """
import json, sys
from bench.gguf import measure_one
model, weights, dtype, chunk, batches, tp, threads = sys.argv[1:]
print(json.dumps(measure_one(model, weights, dtype, int(chunk),
                             [int(b) for b in batches.split(",")], int(tp), int(threads))))
"""
