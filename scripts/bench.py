"""Serving benchmark against any OpenAI-compatible server, ours or another.

    .venv/bin/python scripts/bench.py --url http://127.0.0.1:8000            # a running server
    .venv/bin/python scripts/bench.py --launch --prefill 1 --decode 1        # start ours first

Measures TTFT and tokens/s of one 200-token prompt, output tokens/s at 32 concurrent streams of
64 tokens, and (for a server it launched) resident and proportional memory per process.
Writes JSON to --out and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from core.config import ModelConfig
from engine.prepare import resolve_model

ROOT = Path(__file__).resolve().parents[1]
FILLER = ("The history of computing is a story of people who wanted machines to do arithmetic "
          "faster than any clerk could, and then found that the same machines could do much more. ")


async def stream_one(client: httpx.AsyncClient, model: str, prompt: Any, max_tokens: int) -> dict:
    """One streamed completion: TTFT, per-token times, and the token count the server reports."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            usage = event.get("usage") or usage
    assert usage is not None, "the server sent no usage chunk"
    end = time.perf_counter()
    return {"ttft": arrivals[0] - start, "e2e": end - start, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


async def single_prompt(client: httpx.AsyncClient, model: str, prompt: Any, repeats: int) -> dict:
    runs = [await stream_one(client, model, prompt, 64) for _ in tqdm(range(repeats),
                                                                        desc="200-token prompt")]
    ttft = statistics.median(r["ttft"] for r in runs)
    decode_rate = statistics.median((r["tokens"] - 1) / (r["e2e"] - r["ttft"]) for r in runs)
    return {"prompt_tokens": runs[0]["prompt_tokens"], "ttft_s": ttft,
            "decode_tokens_per_s": decode_rate, "repeats": repeats}


async def concurrent(client: httpx.AsyncClient, model: str, streams: int, tokens: int) -> dict:
    bar = tqdm(total=streams, desc=f"{streams} concurrent streams")

    async def one(i: int) -> dict:
        result = await stream_one(client, model, f"Story number {i}: once upon a time", tokens)
        bar.update()
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(streams)))
    elapsed = time.perf_counter() - start
    bar.close()
    total = sum(r["tokens"] for r in results)
    return {"streams": streams, "tokens_each": tokens, "output_tokens": total,
            "seconds": elapsed, "output_tokens_per_s": total / elapsed,
            "ttft_p50_s": statistics.median(r["ttft"] for r in results)}


def memory(run_dir: Path) -> dict[str, dict[str, float]]:
    """RSS and PSS (MB) of every process launch.sh started."""
    table = {}
    for line in (run_dir / "pids").read_text().split("\n"):
        if line.strip():
            pid, name = line.split()
            info = psutil.Process(int(pid)).memory_full_info()
            table[name] = {"rss_mb": info.rss / 2**20, "pss_mb": info.pss / 2**20}
    return table


def prompt_of(tokenizer_dir: Path | None, tokens: int) -> Any:
    """Exactly `tokens` token ids when the tokenizer is at hand, else text of about that size."""
    if tokenizer_dir is None:
        return FILLER * max(1, tokens // 20)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tokenizer_dir).encode(FILLER * (tokens // 10))
    return ids[:tokens]


async def run(url: str, tokenizer_dir: Path | None, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await stream_one(client, model, "warm up", 8)
        single = await single_prompt(client, model, prompt_of(tokenizer_dir, 200), args.repeats)
        batch = await concurrent(client, model, args.streams, args.tokens)
    return {"url": url, "model": model, "single_200_token_prompt": single,
            "concurrent": batch}


def launch(args: argparse.Namespace, run_dir: Path) -> subprocess.Popen[bytes]:
    command = [str(ROOT / "scripts/launch.sh"), "--prefill", str(args.prefill), "--decode",
               str(args.decode), "--port", str(args.port), "--run-dir", str(run_dir)]
    if args.model:
        command += ["--model", args.model]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert launcher.stdout is not None
    for raw in launcher.stdout:
        line = raw.decode(errors="replace").rstrip()
        print(line, file=sys.stderr)
        if "[launch] ready" in line:
            return launcher
    raise SystemExit("launch.sh exited before the server was ready")


def table(report: dict) -> str:
    single, batch = report["single_200_token_prompt"], report["concurrent"]
    rows = [
        ("TTFT, one 200-token prompt", f"{single['ttft_s'] * 1000:.0f} ms"),
        ("decode tokens/s, one stream", f"{single['decode_tokens_per_s']:.1f}"),
        (f"output tokens/s, {batch['streams']} streams x {batch['tokens_each']} tokens",
         f"{batch['output_tokens_per_s']:.1f}"),
        (f"TTFT p50 at {batch['streams']} streams", f"{batch['ttft_p50_s'] * 1000:.0f} ms"),
    ]
    for name, mem in report.get("memory", {}).items():
        rows.append((f"memory {name} (RSS / PSS)", f"{mem['rss_mb']:.0f} / {mem['pss_mb']:.0f} MB"))
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an OpenAI-compatible server to measure")
    parser.add_argument("--launch", action="store_true", help="start ours with launch.sh")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--model", help="model for --launch (name or folder)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder for exact prompt lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results.json"))
    args = parser.parse_args()
    if not args.url and not args.launch:
        parser.error("give --url or --launch")
    launcher = None
    run_dir = Path(tempfile.mkdtemp(prefix="raging-bench-"))
    try:
        if args.launch:
            launcher = launch(args, run_dir)
            args.url = f"http://127.0.0.1:{args.port}"
            if args.tokenizer is None:
                defaults = ModelConfig()
                args.tokenizer = resolve_model(args.model or defaults.name, defaults.cache_dir)
        report = asyncio.run(run(args.url, args.tokenizer, args))
        if launcher is not None:
            report["memory"] = memory(run_dir)
    finally:
        if launcher is not None:
            launcher.terminate()
            launcher.wait(timeout=60)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(report))


if __name__ == "__main__":
    main()
