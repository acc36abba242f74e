"""`serve`: send one workload to every target (a URL, or ours launched here) and measure it."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench.client import api_root, auth_headers, served_model
from bench.launcher import launched, memory, model_dir, redact
from bench.load import Load, run_load, warm_up
from bench.prompts import PromptMaker, TextPrompts, TokenPrompts
from bench.results import Measured, TargetResults, run_label
from bench.stats import Slo
from bench.summary import summarize
from bench.workloads import RequestSpec


@dataclass(frozen=True)
class Target:
    """A server to measure: at `url`, or ours started with launch.sh `launch_flags`."""

    label: str
    url: str | None = None
    launch_flags: tuple[str, ...] | None = None

    @classmethod
    def from_url(cls, text: str) -> Target:
        """`URL` or `LABEL=URL`; the label defaults to the URL's host:port."""
        label, sep, url = text.partition("=")
        if not sep or "://" in label:
            label, url = urlsplit(text).netloc or text, text
        return cls(label=label, url=url)

    @classmethod
    def from_launch(cls, text: str) -> Target:
        """`FLAGS` or `LABEL=FLAGS` for launch.sh; the label defaults to "raging FLAGS"."""
        label, sep, flags = text.partition("=")
        if not sep or label.startswith("-") or " " in label:
            label, flags = "", text
        words = tuple(shlex.split(flags))
        return cls(label=label or " ".join(["raging", *redact(words)]), launch_flags=words)


@dataclass(frozen=True)
class Plan:
    """What every target gets: warm-up requests, measured requests, loads and the SLO.

    Every load sends `requests`, unless `load_requests` gives each load its own (of prompts no
    other load sends, so that no load finds the last one's prompts in a prefix cache).
    """

    warmup: tuple[RequestSpec, ...]
    requests: tuple[RequestSpec, ...]
    loads: tuple[Load, ...]
    slo: Slo
    model: str | None = None  # the model name to request; None: the server's first
    api_key: str | None = field(default=None, repr=False)  # sent as Bearer; launched ones take it
    load_requests: tuple[tuple[RequestSpec, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.load_requests and len(self.load_requests) != len(self.loads):
            raise ValueError("load_requests needs one tuple of requests per load")

    def requests_of(self, load: int) -> tuple[RequestSpec, ...]:
        """The requests the `load`-th load sends."""
        return self.load_requests[load] if self.load_requests else self.requests


def check_reachable(target: Target, api_key: str | None = None, timeout_s: float = 10) -> None:
    """Raise ValueError, before anything is measured, when a URL target does not answer (or
    refuses `api_key`)."""
    if target.url is None:
        return
    try:
        httpx.get(api_root(target.url) + "/v1/models", headers=auth_headers(api_key),
                  timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as error:
        raise ValueError(f"{target.url} does not answer GET /v1/models: {error}") from error


def prompt_maker(tokenizer: Path | None, targets: Sequence[Target]) -> tuple[PromptMaker, str]:
    """Token-id prompts when a tokenizer is known (given, or the launched model's), else text."""
    launches = [t.launch_flags for t in targets if t.launch_flags is not None]
    folder = tokenizer or (model_dir(launches[0]) if launches else None)
    if folder is None:
        return TextPrompts(), "text (approximate lengths; no tokenizer)"
    return TokenPrompts(folder), f"token ids (exact lengths; tokenizer {folder})"


def measure(target: Target, plan: Plan) -> TargetResults:
    """Every load of `plan` against `target`, launching and stopping it if it is ours."""
    if target.launch_flags is None:
        assert target.url is not None
        model, runs = asyncio.run(_measure_url(target.url, target.label, plan))
        return TargetResults(target.label, target.url, model, runs)
    with launched(target.launch_flags, api_key=plan.api_key) as server:
        model, runs = asyncio.run(_measure_url(server.url, target.label, plan))
        used = memory(server.run_dir)
    return TargetResults(target.label, server.url, model, runs, redact(target.launch_flags),
                         str(server.run_dir), used)


def open_client(url: str, api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    """An HTTP client for the server at `url`: unlimited connections, `api_key` as Bearer."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=api_root(url), timeout=httpx.Timeout(timeout_s),
                             limits=limits, headers=auth_headers(api_key))


async def _measure_url(url: str, label: str, plan: Plan) -> tuple[str, tuple[Measured, ...]]:
    timeout_s = max(load.request_timeout_s for load in plan.loads)
    async with open_client(url, plan.api_key, timeout_s) as client:
        model = plan.model or await served_model(client)
        await warm_up(client, model, plan.warmup, plan.loads[0])
        runs = []
        for index, load in enumerate(plan.loads):
            run = await run_load(client, model, plan.requests_of(index), load,
                                 run_label(label, load))
            runs.append(Measured(load, run, summarize(run, plan.slo)))
    return model, tuple(runs)
