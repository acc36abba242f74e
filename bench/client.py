"""One streamed completion against an OpenAI-compatible server, timed from its SSE stream."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.stats import inter_token_gaps, tpot
from bench.workloads import RequestSpec


class StreamError(Exception):
    """The server answered, but not with a usable completion stream."""


@dataclass(frozen=True)
class RequestResult:
    """What one request measured; times in seconds, `start_s` from the start of its run."""

    index: int
    kind: str
    start_s: float
    input_len: int | None  # prompt tokens as sent (None: text of unknown length)
    max_tokens: int
    error: str = ""  # empty when the request succeeded
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: tuple[float, ...] = ()  # each content chunk's arrival, from the request start
    prompt_tokens: int | None = None  # as the server's usage reports them
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported

    @property
    def ok(self) -> bool:
        """True when a complete stream with at least one token came back in time."""
        return not self.error

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for failures and one-token answers)."""
        if self.ttft_s is None or self.e2e_s is None:
            return None
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)

    @property
    def itl_s(self) -> list[float]:
        """Every gap between consecutive content chunks."""
        return inter_token_gaps(self.chunk_times_s)


def api_root(url: str) -> str:
    """The server root of `url`, which may or may not end in /v1."""
    root = url.rstrip("/")
    return root.removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries `api_key`, as OpenAI's own client sends it; none without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_path(spec: RequestSpec) -> str:
    """Where `spec` is sent: /v1/chat/completions for a chat request, else /v1/completions."""
    return "/v1/chat/completions" if spec.chat else "/v1/completions"


def request_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    """A greedy, EOS-ignoring, streamed body asking for exactly output_len tokens: the prompt,
    or for a chat request the prompt as one user message."""
    prompt = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
    asked: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt}]} if spec.chat
                             else {"prompt": prompt})
    return {"model": model, **asked, "max_tokens": spec.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def served_model(client: httpx.AsyncClient) -> str:
    """The id of the first model the server lists at /v1/models."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def stream_request(client: httpx.AsyncClient, model: str, spec: RequestSpec,
                         timeout_s: float, run_start: float) -> RequestResult:
    """Send `spec`, read its whole stream (at most `timeout_s`), and time every content chunk."""
    start = time.perf_counter()
    base = RequestResult(spec.index, spec.kind, start - run_start, spec.input_len,
                         spec.output_len)
    try:
        async with asyncio.timeout(timeout_s):
            arrivals, usage, _ = await read_stream(client, request_path(spec),
                                                   request_body(model, spec), start)
    except TimeoutError:
        return _failed(base, f"timeout after {timeout_s:g}s")
    except httpx.HTTPError as error:
        return _failed(base, f"{type(error).__name__}: {error}")
    except StreamError as error:
        return _failed(base, str(error))
    return _succeeded(base, arrivals, usage, time.perf_counter() - start)


def _failed(base: RequestResult, error: str) -> RequestResult:
    return RequestResult(base.index, base.kind, base.start_s, base.input_len, base.max_tokens,
                         error=error or "failed")


def _succeeded(base: RequestResult, arrivals: list[float], usage: dict[str, Any] | None,
               e2e_s: float) -> RequestResult:
    if not arrivals:
        return _failed(base, "stream ended without any token")
    usage = usage or {}
    return RequestResult(
        base.index, base.kind, base.start_s, base.input_len, base.max_tokens,
        ttft_s=arrivals[0], e2e_s=e2e_s, chunk_times_s=tuple(arrivals),
        prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=int(usage.get("completion_tokens", len(arrivals))),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    )


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      start: float) -> tuple[list[float], dict[str, Any] | None, str]:
    """(content-chunk arrival times from `start`, the usage chunk if any, the text) of one
    stream."""
    arrivals: list[float] = []
    parts: list[str] = []
    usage = None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {response.status_code}: {text[:200]}")
        async for line in response.aiter_lines():
            event = parse_event(line)
            if event is None:
                continue
            if has_content(event):
                arrivals.append(time.perf_counter() - start)
                parts.append(content_of(event))
            usage = event.get("usage") or usage
    return arrivals, usage, "".join(parts)


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON payload of one SSE `data:` line; None for comments, blanks and [DONE]."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except json.JSONDecodeError as error:
        raise StreamError(f"malformed SSE data: {payload[:100]!r}") from error
    if not isinstance(event, dict):
        raise StreamError(f"SSE data is not an object: {payload[:100]!r}")
    if "error" in event:
        raise StreamError(f"error in stream: {json.dumps(event['error'])[:200]}")
    return event


def content_of(event: dict[str, Any]) -> str:
    """The generated text of a chunk (completions `text` or chat `delta.content`)."""
    choice = (event.get("choices") or [{}])[0]
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def has_content(event: dict[str, Any]) -> bool:
    """Whether a chunk carries generated text."""
    return bool(content_of(event))
