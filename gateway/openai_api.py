"""The OpenAI routes: /v1/chat/completions, /v1/completions (streaming and not), /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from core.messages import GenerationTask, Sampling
from gateway.auth import cache_salt
from gateway.errors import (
    APIError,
    bad_request,
    not_found,
    payload_too_large,
    rate_limited,
    service_unavailable,
)
from gateway.generation import KEEPALIVE, Delta, Generation
from gateway.logprobs import TokenLogprob, TokenPieces, chat_logprobs, completion_logprobs
from gateway.protocol import (
    GenerationParams,
    check_context,
    generation_params,
    parse_chat_request,
    parse_completion_request,
    render_chat_prompt,
    tokenize_prompt,
)
from gateway.state import GatewayState

Logprobs = Sequence[TokenLogprob] | None  # None: the request did not ask for logprobs


class ChatFormat:
    """Shapes of /v1/chat/completions responses."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice_delta(self, text: str, reason: str | None, first: bool,
                     logprobs: Logprobs = None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        shown = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": 0, "delta": delta, "logprobs": shown, "finish_reason": reason}

    def choice_full(self, text: str, reason: str | None,
                    logprobs: Logprobs = None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        shown = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": 0, "message": message, "logprobs": shown, "finish_reason": reason}


class CompletionFormat:
    """Shapes of /v1/completions responses."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def choice_delta(self, text: str, reason: str | None, first: bool,
                     logprobs: Logprobs = None) -> dict[str, Any]:
        shown = None if logprobs is None else completion_logprobs(logprobs)
        return {"index": 0, "text": text, "logprobs": shown, "finish_reason": reason}

    def choice_full(self, text: str, reason: str | None,
                    logprobs: Logprobs = None) -> dict[str, Any]:
        return self.choice_delta(text, reason, first=False, logprobs=logprobs)


Format = ChatFormat | CompletionFormat


class OpenAIRoutes:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.pieces = TokenPieces(state.tokenizer)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_chat_request(await self._read_body(request))
        self._check_model(body.model)
        prompt_ids = await self._tokenize(render_chat_prompt, body.messages)
        return await self._serve(request, ChatFormat(), prompt_ids, generation_params(body))

    async def completions(self, request: Request) -> Response:
        body = parse_completion_request(await self._read_body(request))
        self._check_model(body.model)
        prompt_ids = await self._tokenize(tokenize_prompt, body.prompt)
        return await self._serve(request, CompletionFormat(), prompt_ids, generation_params(body))

    async def _tokenize(self, function: Callable[[Any, Any], list[int]], text: Any) -> list[int]:
        """Off the event loop (a huge prompt must not stall /health), on the one tokenizer thread:
        a Hugging Face fast tokenizer must not be used by two threads at once."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, function, self.state.tokenizer,
                                          text)

    async def models(self, request: Request) -> Response:
        card = {"id": self.state.model_name, "object": "model", "created": self.state.started,
                "owned_by": "raging", "max_model_len": self.state.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def _read_body(self, request: Request) -> bytes:
        """The body, refusing (413) anything over the limit without buffering it."""
        limit = self.state.config.gateway.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise payload_too_large(f"request body exceeds {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():  # ClientDisconnect: handled by the app
            size += len(chunk)
            if size > limit:
                raise payload_too_large(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str) -> None:
        if model != self.state.model_name:
            raise not_found(f"The model '{model[:100]}' does not exist; this server serves "
                            f"'{self.state.model_name}'.", param="model", code="model_not_found")

    def _admit(self, prompt_tokens: int) -> None:
        """429 at once when the queue is full, in requests or in prompt tokens waiting for
        prefill (a prompt over the token bound alone still gets in when nothing waits)."""
        limits = self.state.config.gateway
        if len(self.state.dispatcher.requests) >= limits.max_inflight_requests:
            raise rate_limited("too many requests in flight; retry shortly", retry_after=1.0)
        queued = self.state.registry.queued_prompt_tokens()
        if queued and queued + prompt_tokens > limits.max_queued_tokens:
            raise rate_limited(f"{queued} prompt tokens are already waiting for prefill; "
                               "retry shortly", retry_after=1.0)

    async def _serve(self, request: Request, fmt: Format, prompt_ids: list[int],
                     params: GenerationParams) -> Response:
        capacity = self.state.registry.capacity_tokens() or self.state.max_model_len
        limit = min(self.state.max_model_len, capacity)
        max_tokens = check_context(len(prompt_ids), params.max_tokens, limit)
        vocab = len(self.state.tokenizer)
        if any(token >= vocab for token in params.stop_token_ids):
            raise bad_request(f"stop_token_ids must be below {vocab}", param="stop_token_ids")
        if not self.state.control_plane_up():
            raise service_unavailable("the gateway lost its control plane", retry_after=5.0)
        self._admit(len(prompt_ids))
        task = generation_task(params, prompt_ids, max_tokens, cache_salt(request))
        handle = self.state.dispatcher.submit(task)
        self.state.metrics.prompt_tokens.inc(len(prompt_ids))
        logprobs = params.logprobs is not None
        generation = Generation(handle, self.state.dispatcher, self.state.metrics,
                                self.state.tokenizer, params.stop,
                                self.pieces if logprobs else None)
        reply = Reply(fmt, generation, self.state, params.include_usage, logprobs)
        echoed = client_request_id(request)
        if params.stream:
            return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **echoed})
        response = await reply.whole(request)
        response.headers.update(echoed)
        return response


def generation_task(params: GenerationParams, prompt_ids: list[int], max_tokens: int,
                    salt: str) -> GenerationTask:
    """What the workers get for a request."""
    sampling = Sampling(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logprobs=params.logprobs,
    )
    return GenerationTask(
        prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        cache_salt=salt, min_tokens=params.min_tokens, output_start=len(prompt_ids),
        grammar=params.grammar,
    )


@dataclass(frozen=True)
class _Whole:
    """A generation collected to its end."""

    text: str
    finish_reason: str | None
    error: str
    logprobs: list[TokenLogprob]


class Reply:
    """One response, streamed as SSE chunks or returned whole; with `logprobs`, each choice
    carries the logprobs of its tokens."""

    def __init__(self, fmt: Format, generation: Generation, state: GatewayState,
                 include_usage: bool, logprobs: bool = False) -> None:
        prefix = "chatcmpl" if isinstance(fmt, ChatFormat) else "cmpl"
        self.id = f"{prefix}-{generation.handle.request_id}"
        self.fmt = fmt
        self.generation = generation
        self.state = state
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.created = int(time.time())

    def _deltas(self) -> AsyncIterator[Delta | None]:
        gateway = self.state.config.gateway
        return self.generation.deltas(gateway.keepalive_s, gateway.progress_timeout_s)

    async def sse(self) -> AsyncIterator[str]:
        outcome = "aborted"
        try:
            if isinstance(self.fmt, ChatFormat):
                yield self._event([self.fmt.choice_delta("", None, first=True)])
            async for delta in self._deltas():
                if delta is KEEPALIVE:
                    yield ": keepalive\n\n"
                elif delta.finish_reason == "error":
                    outcome = "error"
                    yield f"data: {json.dumps(_stream_error(delta.error))}\n\n"
                    return
                else:
                    logprobs = delta.logprobs if self.logprobs else None
                    yield self._event([self.fmt.choice_delta(delta.text, delta.finish_reason,
                                                              False, logprobs)])
            outcome = "ok"
            if self.include_usage:
                yield self._event([], usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:
            self._close(outcome)

    async def whole(self, request: Request) -> Response:
        """The complete response; a client that disconnects first aborts the request."""
        watcher = asyncio.create_task(_wait_for_disconnect(request))
        collector = asyncio.create_task(self._collect())
        outcome = "aborted"
        try:
            done, _ = await asyncio.wait({watcher, collector},
                                         return_when=asyncio.FIRST_COMPLETED)
            if collector not in done:
                return Response(status_code=499)  # nobody is listening
            whole = collector.result()
            if whole.error:
                outcome = "error"
                return JSONResponse(_stream_error(whole.error), status_code=503)
            outcome = "ok"
            logprobs = whole.logprobs if self.logprobs else None
            choice = self.fmt.choice_full(whole.text, whole.finish_reason, logprobs)
            return JSONResponse(self._body([choice], usage=self._usage()))
        finally:
            watcher.cancel()
            collector.cancel()
            self._close(outcome)

    async def _collect(self) -> _Whole:
        """The generation, once it ends."""
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        async for delta in self._deltas():
            if delta is KEEPALIVE:
                continue
            if delta.finish_reason == "error":
                return _Whole("", None, delta.error, [])
            parts.append(delta.text)
            logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                return _Whole("".join(parts), delta.finish_reason, "", logprobs)
        raise AssertionError("a generation always ends with a finish_reason")

    def _close(self, outcome: str) -> None:
        self.generation.close()
        route = "chat" if isinstance(self.fmt, ChatFormat) else "completions"
        self.state.metrics.requests.labels(route, outcome).inc()

    def _usage(self) -> dict[str, Any]:
        prompt, completion = self.generation.prompt_tokens, self.generation.completion_tokens
        cached = self.generation.handle.cached_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": self.fmt.object_name, "created": self.created,
                "model": self.state.model_name, "choices": choices, "usage": usage}

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        """One SSE chunk; `usage` only on the last one, when the client asked for it."""
        chunk: dict[str, Any] = {"id": self.id, "object": self.fmt.chunk_object_name,
                                 "created": self.created, "model": self.state.model_name,
                                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"


def _stream_error(message: str) -> dict[str, Any]:
    return APIError(503, message, "server_error", code="generation_failed").to_body()


def client_request_id(request: Request) -> dict[str, str]:
    """The client's X-Request-Id to echo back, if it is a sane one. It is only echoed: the
    server names requests itself, so two requests with the same id never share state."""
    value = request.headers.get("x-request-id", "")
    if 0 < len(value) <= 128 and value.isascii() and value.isprintable():
        return {"X-Request-Id": value}
    return {}


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
