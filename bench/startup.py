"""`python -m bench startup`: how long `scripts/launch.sh` takes until it is ready, until it
has answered a first request, and, told to stop, until every process it started is gone; a
few runs of each launch's flags, one after another."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.launcher import launched, redact
from bench.report import write_json

DEFAULT_LAUNCH = "--prefill 1 --decode 1"


@dataclass(frozen=True)
class StartupRun:
    """One launch, in seconds from `launch.sh` being started (stopped: from the stop asked)."""

    ready_s: float
    first_answer_s: float
    stopped_s: float


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("startup", help="launch.sh: time to ready and to stopped")
    parser.add_argument("--launch", action="append", default=[], metavar="FLAGS",
                        help=f"launch.sh flags, repeatable (default: {DEFAULT_LAUNCH!r})")
    parser.add_argument("--runs", type=int, default=3, help="launches of each (default: 3)")
    parser.add_argument("--out", type=Path, default=Path("runs/startup.json"))
    parser.set_defaults(prepare=prepare)


def prepare(args: argparse.Namespace, argv: Sequence[str]) -> Callable[[], int]:
    if args.runs < 1:
        raise ValueError("--runs takes a positive count")
    launches = [flags.split() for flags in args.launch or [DEFAULT_LAUNCH]]
    return lambda: run(launches, args.runs, args.out)


def run(launches: Sequence[list[str]], runs: int, out: Path) -> int:
    """Launch each in turn `runs` times; write JSON and print a Markdown table."""
    measured: dict[str, list[StartupRun]] = {}
    with tqdm(total=len(launches) * runs, desc="launches", unit="launch") as bar:
        for flags in launches:
            label = " ".join(redact(flags))
            for _ in range(runs):
                measured.setdefault(label, []).append(time_launch(flags))
                bar.update()
    write_json({label: [asdict(r) for r in results] for label, results in measured.items()},
               out)
    print(startup_markdown(measured))
    print(f"\nwrote {out}", flush=True)
    return 0


def time_launch(flags: Sequence[str]) -> StartupRun:
    """One launch of `flags`, timed: to ready, to a first completion, and to every process
    gone once stopped (launch.sh told to stop by SIGTERM, as a benchmark stops it)."""
    started = time.monotonic()
    with launched(flags) as server:
        ready_s = time.monotonic() - started
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        answer = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "Hello", "max_tokens": 1})
        answer.raise_for_status()
        first_answer_s = time.monotonic() - started
        stopping = time.monotonic()
    stopped_s = time.monotonic() - stopping
    return StartupRun(ready_s, first_answer_s, stopped_s)


def startup_markdown(measured: dict[str, list[StartupRun]]) -> str:
    """Per launch: the first run (which may prepare the model and kernels) and the median of
    the rest."""
    lines = ["| launch.sh flags | runs | first: ready / answered / stopped (s) | "
             "median of the others (s) |", "|---|---|---|---|"]
    for label, results in measured.items():
        first, rest = results[0], results[1:]
        others = "-" if not rest else " / ".join(
            f"{statistics.median(getattr(r, name) for r in rest):.2f}"
            for name in ("ready_s", "first_answer_s", "stopped_s"))
        lines.append(f"| `{label}` | {len(results)} | {first.ready_s:.2f} / "
                     f"{first.first_answer_s:.2f} / {first.stopped_s:.2f} | {others} |")
    return "\n".join(lines)
