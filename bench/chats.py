"""`chats`: multi-turn chats, the time to first token of each turn with prefix caching on and off,
or with pulls of cached prefixes between workers on and off.

Per layout, two launched servers, one after the other. Against `caching-off`: prefix caching on
(as shipped) and off (`prefill.prefix_caching` and `decode.prefix_caching` false). Against
`no-pulls`: each turn is sent on purpose to a decode worker that does not hold its history
(`gateway.history_routing: spread`), which pulls it from the one that does, or with
`gateway.pull_prefixes: never` computes it. On each server, `chats` chats at once,
each of `turns` turns through /v1/chat/completions, greedy: turn 1 sends a document of about
`document_len` tokens and a question; every later turn sends the whole history (the earlier
questions, and the answers as the server gave them) and a new question, as a chat UI does, so
that the history grows to about document_len + turns * (question_len + output_len) tokens.
With caching on, turn k > 1 finds the history cached where turn k - 1 was decoded. A short
request of its own warms each server up first.

Reports per layout and turn: median TTFT on and off, their ratio, the cached tokens the
server reported, and whether every turn's answer was the same on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from tqdm import tqdm

from bench.client import StreamError, read_stream, served_model
from bench.launcher import launched
from bench.prompts import TextPrompts
from bench.report import write_json

Against = Literal["caching-off", "no-pulls"]
SPREAD = ("--set", "gateway.history_routing=spread")
# The flags of the measured feature on, and off.
VARIANTS: dict[Against, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "caching-off": ((), ("--set", "prefill.prefix_caching=false",
                         "--set", "decode.prefix_caching=false")),
    "no-pulls": (SPREAD, (*SPREAD, "--set", "gateway.pull_prefixes=never")),
}
_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ChatsPlan:
    launches: tuple[tuple[str, tuple[str, ...]], ...]  # (name, launch.sh flags)
    against: Against
    chats: int
    turns: int
    document_len: int
    question_len: int
    output_len: int


@dataclass(frozen=True)
class Turn:
    """One turn of one chat as measured."""

    chat: int
    turn: int  # 1-based
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


@dataclass(frozen=True)
class Run:
    layout: str
    on: bool  # the measured feature: on, or off
    turns: tuple[Turn, ...]


def run(plan: ChatsPlan) -> list[Run]:
    """Every layout, the feature on then off, one server at a time."""
    runs = []
    for name, flags in plan.launches:
        for on, extra in zip((True, False), VARIANTS[plan.against], strict=True):
            label = f"{name}, {'on' if on else plan.against}"
            with launched((*flags, *extra)) as server:
                turns = asyncio.run(_chats(server.url, plan, label))
            runs.append(Run(name, on, tuple(turns)))
    return runs


async def _chats(url: str, plan: ChatsPlan, label: str) -> list[Turn]:
    async with httpx.AsyncClient(base_url=url, timeout=_TIMEOUT_S) as client:
        model = await served_model(client)
        warm_up = {"model": model, "messages": [{"role": "user", "content": "Warm up."}],
                   "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        await _stream(client, warm_up)  # a fresh server's first request is slower
        progress = tqdm(total=plan.chats * plan.turns, desc=label, unit="turn")
        chats = [_chat(client, model, plan, chat, progress) for chat in range(plan.chats)]
        done = await asyncio.gather(*chats)
        progress.close()
    return [turn for chat in done for turn in chat]


async def _chat(client: httpx.AsyncClient, model: str, plan: ChatsPlan, chat: int,
                progress: tqdm) -> list[Turn]:
    """One chat's turns in order, each with the history so far."""
    prompts = TextPrompts()
    messages: list[dict[str, str]] = []
    measured = []
    for turn in range(1, plan.turns + 1):
        question = _question(prompts, chat, turn, plan.question_len)
        if turn == 1:
            question = f"{prompts.prompt(chat, plan.document_len)}\n\n{question}"
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": messages, "max_tokens": plan.output_len,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        result = await _stream(client, body)
        measured.append(Turn(chat, turn, *result))
        messages.append({"role": "assistant", "content": result[-1]})
        progress.update()
    return measured


def _question(prompts: TextPrompts, chat: int, turn: int, length: int) -> str:
    return f"Question {turn}: in a few sentences, {prompts.prompt(chat * 100 + turn, length)}?"


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]
                  ) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens, cached tokens, answer) of one streamed chat completion."""
    arrivals, usage, answer = await read_stream(client, "/v1/chat/completions", body,
                                                time.perf_counter())
    if not arrivals or usage is None:
        raise StreamError("the stream ended without an answer or its usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return arrivals[0], int(usage["prompt_tokens"]), int(cached), answer


def summary(plan: ChatsPlan, runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per layout and turn: median TTFT on and off, the ratio, cached and prompt tokens, and
    how many answers were the same; then turns 2 on as one row."""
    rows = []
    for name, _ in plan.launches:
        on, off = (next(r for r in runs if r.layout == name and r.on is c)
                   for c in (True, False))
        groups = [(str(t), [t]) for t in range(1, plan.turns + 1)]
        groups.append((f"2-{plan.turns}", list(range(2, plan.turns + 1))))
        for label, turns in groups:
            rows.append(_row(name, label, [t for t in on.turns if t.turn in turns],
                             [t for t in off.turns if t.turn in turns]))
    return rows


def _row(layout: str, label: str, on: Sequence[Turn], off: Sequence[Turn]) -> dict[str, Any]:
    def key(turn: Turn) -> tuple[int, int]:
        return turn.chat, turn.turn

    answers_off = {key(t): t.answer for t in off}
    ttft_on = statistics.median(t.ttft_s for t in on)
    ttft_off = statistics.median(t.ttft_s for t in off)
    return {"layout": layout, "turns": label, "ttft_on_ms": round(ttft_on * 1000, 1),
            "ttft_off_ms": round(ttft_off * 1000, 1), "ratio": round(ttft_on / ttft_off, 3),
            "prompt_tokens": statistics.median(t.prompt_tokens for t in on),
            "cached_tokens_on": statistics.median(t.cached_tokens for t in on),
            "cached_tokens_off": max(t.cached_tokens for t in off),
            "same_answers": sum(answers_off[key(t)] == t.answer for t in on), "of": len(on)}


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| layout | turns | prompt tokens (median) | cached on (median) | TTFT ms on | "
             "TTFT ms off | on / off | same answers |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['turns']} | {r['prompt_tokens']:.0f} | "
              f"{r['cached_tokens_on']:.0f} | {r['ttft_on_ms']:.0f} | {r['ttft_off_ms']:.0f} | "
              f"{r['ratio']:.2f}x | {r['same_answers']}/{r['of']} |" for r in rows]
    return "\n".join(lines)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench chats`: multi-turn chats, TTFT with prefix caching on and off."""
    parser = commands.add_parser("chats", help="multi-turn chats: TTFT, caching or pulls on "
                                 "vs off", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch", action="append", metavar="NAME=FLAGS",
                        help="a layout: its name and launch.sh flags (repeatable; default: "
                             "colocated1=--colocated 1)")
    parser.add_argument("--against", choices=typing.get_args(Against), default="caching-off",
                        help="what the shipped settings are compared with (default: "
                             "%(default)s)")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--document-len", type=int, default=1100)
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the measurements here (JSON)")
    parser.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if min(args.chats, args.turns, args.document_len, args.question_len,
           args.output_len) < 1 or args.turns < 2:
        raise ValueError("counts and lengths must be >= 1, --turns >= 2")
    launches = []
    for spec in args.launch or ["colocated1=--colocated 1"]:
        name, _, flags = spec.partition("=")
        if not name or not flags:
            raise ValueError(f"--launch wants NAME=FLAGS, got {spec!r}")
        launches.append((name, tuple(shlex.split(flags))))
    plan = ChatsPlan(tuple(launches), args.against, args.chats, args.turns, args.document_len,
                     args.question_len, args.output_len)

    def job() -> int:
        runs = run(plan)
        rows = summary(plan, runs)
        print(markdown(rows))
        if args.out:
            write_json({"plan": asdict(plan), "command": ["python", "-m", "bench", *argv],
                        "summary": rows, "runs": [asdict(r) for r in runs]}, args.out)
            print(f"\nwrote {args.out}", file=sys.stderr)
        return 0
    return job
