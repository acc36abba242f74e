"""Request traces: when each request arrives and how long its prompt and answer are, one JSON
object a line, for `python -m bench policies` to replay.

    {"arrival_s": 0.0, "prompt_tokens": 1180, "output_tokens": 96, "prefix_group": "g3",
     "prefix_tokens": 1000}

- `arrival_s`: seconds from the trace's start, never less than the line before's;
- `prompt_tokens`, `output_tokens`: integers >= 1;
- `prefix_group`: a string, or null: requests of one group share the first `prefix_tokens`
  tokens of their prompts (a system prompt, a document);
- `prefix_tokens` (optional, default 0): at most `prompt_tokens`; above 0 only with a group.

Reading is strict: an unknown or missing key, a wrong type or an arrival out of order is an
error naming its line. `python -m bench trace write` writes one from the bench's workloads
(bench/workloads.py) with Poisson arrivals (bench/load.py), optionally in prefix groups:
`--groups N --prefix-len P` gives each request one of N groups, uniformly at random, and P
shared tokens before the workload's own prompt (`--grouped-share S`: only a share S of the
requests, the rest in no group).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load import arrival_offsets
from bench.workloads import WORKLOADS, Workload, build
from core.codec import is_int

REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens", "prefix_group")
OPTIONAL = ("prefix_tokens",)


class TraceError(ValueError):
    """A trace file that is not in the format; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (see the module's docstring for the fields)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        if self.prefix_group == "":
            raise ValueError("prefix_group must be a non-empty string or null")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"prefix_tokens must be in [0, prompt_tokens], "
                             f"got {self.prefix_tokens}")
        if self.prefix_tokens and self.prefix_group is None:
            raise ValueError("prefix_tokens > 0 needs a prefix_group")

    def as_json(self) -> dict[str, Any]:
        """The line's object; `prefix_tokens` only where it is not 0."""
        line: dict[str, Any] = {"arrival_s": round(self.arrival_s, 6),
                                "prompt_tokens": self.prompt_tokens,
                                "output_tokens": self.output_tokens,
                                "prefix_group": self.prefix_group}
        return line | ({"prefix_tokens": self.prefix_tokens} if self.prefix_tokens else {})


def parse_line(text: str) -> TraceRequest:
    """One request from one line of a trace; ValueError saying what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error.msg}") from error
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    missing = [key for key in REQUIRED if key not in raw]
    unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
    if missing or unknown:
        raise ValueError(f"missing keys {missing}" if missing else f"unknown keys {unknown}")
    _check_types(raw)
    return TraceRequest(float(raw["arrival_s"]), raw["prompt_tokens"], raw["output_tokens"],
                        raw["prefix_group"], raw.get("prefix_tokens", 0))


def _check_types(raw: dict[str, Any]) -> None:
    if not _is_number(raw["arrival_s"]):
        raise ValueError("arrival_s must be a number")
    for key in ("prompt_tokens", "output_tokens", *OPTIONAL):
        if key in raw and not is_int(raw[key]):
            raise ValueError(f"{key} must be an integer")
    if raw["prefix_group"] is not None and not isinstance(raw["prefix_group"], str):
        raise ValueError("prefix_group must be a string or null")


def _is_number(value: object) -> bool:
    return is_int(value) or isinstance(value, float)


def parse_trace(text: str, where: str = "trace") -> tuple[TraceRequest, ...]:
    """Every request of a trace's text, in order; TraceError naming `where` and the line of
    the first bad one (a blank line, an empty trace and arrivals out of order are errors)."""
    requests: list[TraceRequest] = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            if not line.strip():
                raise ValueError("blank line")
            request = parse_line(line)
            if requests and request.arrival_s < requests[-1].arrival_s:
                raise ValueError(f"arrival_s {request.arrival_s} is before the line before's "
                                 f"({requests[-1].arrival_s})")
        except ValueError as error:
            raise TraceError(f"{where}:{number}: {error}") from error
        requests.append(request)
    if not requests:
        raise TraceError(f"{where}: no requests")
    return tuple(requests)


def read_trace(path: Path) -> tuple[TraceRequest, ...]:
    """The requests of the trace file at `path` (see `parse_trace`)."""
    return parse_trace(path.read_text(), str(path))


def format_trace(requests: Iterable[TraceRequest]) -> str:
    """A trace's text: one JSON object a line."""
    return "".join(json.dumps(request.as_json()) + "\n" for request in requests)


def write_trace(requests: Iterable[TraceRequest], path: Path) -> None:
    """Write `requests` to `path` as a trace, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_trace(requests))


class ByteLengths:
    """A bench PromptMaker for traces: lengths only. Text counts its UTF-8 bytes, as many
    tokens as the simulated model's byte vocabulary (engine/sim/tokens.py) makes of it."""

    def prompt(self, index: int, length: int) -> tuple[int, ...]:
        return (32,) * length  # only its length goes into a trace

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))


@dataclass(frozen=True)
class Grouping:
    """Prefix groups over a workload's requests: a `share` of them (drawn at random) each in
    one of `groups` groups (0: none), drawn uniformly, with `prefix_tokens` shared tokens
    before its own prompt; the others as the workload made them."""

    groups: int = 0
    prefix_tokens: int = 0
    share: float = 1.0

    def __post_init__(self) -> None:
        if self.groups < 0 or self.prefix_tokens < 0:
            raise ValueError("groups and prefix tokens must be >= 0")
        if self.prefix_tokens and not self.groups:
            raise ValueError("a shared prefix needs groups")
        if not 0 <= self.share <= 1:
            raise ValueError(f"the grouped share must be in [0, 1], got {self.share}")

    def draw(self, count: int, rng: random.Random) -> list[str | None]:
        """The group of each of `count` requests (None: in none)."""
        groups = [f"g{rng.randrange(self.groups)}" if self.groups else None
                  for _ in range(count)]
        return [group if rng.random() < self.share else None for group in groups]


def workload_trace(workload: Workload, count: int, rate: float,
                   grouping: Grouping = Grouping()) -> tuple[TraceRequest, ...]:
    """`count` requests of `workload` (its seed draws lengths, arrivals and groups alike),
    arriving as a Poisson process at `rate` per second, in `grouping`'s prefix groups."""
    if count < 1 or not rate > 0:
        raise ValueError("a trace needs count >= 1 and rate > 0")
    specs = build(workload, ByteLengths(), count)
    arrivals = arrival_offsets(count, rate, random.Random(workload.seed))
    groups = grouping.draw(count, random.Random(f"groups-{workload.seed}"))
    return tuple(
        TraceRequest(arrival, (spec.input_len or 1) + (grouping.prefix_tokens if group else 0),
                     spec.output_len, group, grouping.prefix_tokens if group else 0)
        for spec, arrival, group in zip(specs, arrivals, groups, strict=True))


def describe(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """A trace's size and shape: requests, span, mean rate and lengths, groups."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    count = len(requests)
    return {"requests": count, "span_s": span,
            "rate": (count - 1) / span if span > 0 else None,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / count,
            "mean_output_tokens": sum(r.output_tokens for r in requests) / count,
            "groups": len({r.prefix_group for r in requests if r.prefix_group is not None}),
            "grouped": sum(r.prefix_group is not None for r in requests)}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """`python -m bench trace write ...`."""
    parser = commands.add_parser("trace", help="request traces for `policies` to replay",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="trace_command", required=True)
    write = actions.add_parser("write", help="a trace of a bench workload, Poisson arrivals")
    write.add_argument("--workload", choices=WORKLOADS, default="chat")
    write.add_argument("--rate", type=float, required=True, help="arrivals per second")
    write.add_argument("--count", type=int, required=True, help="requests")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--input-len", type=int, default=200, help="fixed, messages")
    write.add_argument("--output-len", type=int, default=64, help="fixed, humaneval, messages")
    write.add_argument("--max-output-len", type=int, help="cap every output length")
    write.add_argument("--long-share", type=float, default=0.07, help="mixed")
    write.add_argument("--groups", type=int, default=0, help="prefix groups (0: none)")
    write.add_argument("--prefix-len", type=int, default=0,
                       help="tokens each group's requests share before their own prompt")
    write.add_argument("--grouped-share", type=float, default=1.0,
                       help="the share of requests in a group (the rest in none)")
    write.add_argument("--out", type=Path, required=True)
    write.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    workload = Workload(args.workload, args.input_len, args.output_len, args.long_share,
                        args.seed, args.max_output_len)
    grouping = Grouping(args.groups, args.prefix_len, args.grouped_share)
    if args.count < 1 or not args.rate > 0:
        raise ValueError("--count must be >= 1 and --rate > 0")

    def job() -> int:
        requests = workload_trace(workload, args.count, args.rate, grouping)
        write_trace(requests, args.out)
        print(json.dumps(describe(requests)))
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    return job
