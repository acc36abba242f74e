"""The OpenAI routes: /v1/chat/completions, /v1/completions (streaming and not), /v1/models."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

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
from gateway.generation import Generation
from gateway.handle import RequestHandle
from gateway.logprobs import TokenPieces
from gateway.protocol import (
    GenerationParams,
    check_context,
    generation_params,
    parse_chat_request,
    parse_completion_request,
    render_chat_prompt,
    tokenize_prompt,
)
from gateway.reply import ChatFormat, CompletionFormat, Format, Reply
from gateway.state import GatewayState
from gateway.timing import TIMING_HEADER, asks_for_timing
from gateway.tools import ToolPlan, tool_plan

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class OpenAIRoutes:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.pieces = TokenPieces(state.tokenizer)

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        body = parse_chat_request(await self._read_body(request))
        self._check_model(body.model)
        gateway = self.state.config.gateway
        tools = tool_plan(body, gateway.tool_call_parser, gateway.max_parallel_tool_calls)
        prompt_ids = await self._tokenize(functools.partial(render_chat_prompt, tools=tools),
                                          body.messages)
        params = generation_params(body)
        if tools is not None and tools.grammar:
            params = dataclasses.replace(params, grammar=tools.grammar)
        return await self._serve(request, ChatFormat(), [prompt_ids], params, arrived,
                                 tools)

    async def completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        body = parse_completion_request(await self._read_body(request))
        self._check_model(body.model)
        prompts = [await self._tokenize(tokenize_prompt, prompt) for prompt in body.prompt]
        return await self._serve(request, CompletionFormat(), prompts, generation_params(body),
                                 arrived)

    async def _tokenize(self, function: Callable[[Any, Any], list[int]], text: Any) -> list[int]:
        """Off the event loop (a huge prompt must not stall /health), on the one tokenizer thread:
        a Hugging Face fast tokenizer must not be used by two threads at once."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, function, self.state.tokenizer,
                                          text)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{model}` (the openai client's `models.retrieve`): its card, or 404."""
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, object]:
        return {"id": self.state.model_name, "object": "model", "created": self.state.started,
                "owned_by": "raging", "max_model_len": self.state.max_model_len}

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

    async def _serve(self, request: Request, fmt: Format, prompts: list[list[int]],
                     params: GenerationParams, arrived: float,
                     tools: ToolPlan | None = None) -> Response:
        """`arrived`: when the request came in, where its gateway_queue stage starts."""
        capacity = self.state.registry.capacity_tokens() or self.state.max_model_len
        limit = min(self.state.max_model_len, capacity)
        max_tokens = [check_context(len(ids), params.max_tokens, limit) for ids in prompts]
        vocab = len(self.state.tokenizer)
        if any(token >= vocab for token in params.stop_token_ids):
            raise bad_request(f"stop_token_ids must be below {vocab}", param="stop_token_ids")
        if not self.state.control_plane_up():
            raise service_unavailable("the gateway lost its control plane", retry_after=5.0)
        prompt_tokens = sum(len(ids) for ids in prompts)
        self._admit(prompt_tokens)
        tasks = [generation_task(params, ids, most, cache_salt(request))
                 for ids, most in zip(prompts, max_tokens, strict=True)]
        span = self._open_span(request, arrived, prompt_tokens, params.n)
        handles = self._submit(tasks, params.n, arrived, span)
        self.state.metrics.prompt_tokens.inc(prompt_tokens)
        logprobs = params.logprobs is not None
        generations = [Generation(handle, self.state.dispatcher.abort, self.state.metrics,
                                  self.state.tokenizer, params.stop,
                                  self.pieces if logprobs else None) for handle in handles]
        timing = asks_for_timing(request.headers.get(TIMING_HEADER), params.timing)
        reply = Reply(fmt, generations, self.state, params.include_usage, logprobs, params.n,
                      timing, span, tools)
        echoed = client_request_id(request)
        if params.stream:
            return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **echoed})
        response = await reply.whole(request)
        response.headers.update(echoed)
        return response

    def _open_span(self, request: Request, arrived: float, prompt_tokens: int,
                   n: int) -> Span | None:
        """The request's span (a child of the client's `traceparent`, if it sent one); None
        when tracing is off."""
        tracer = self.state.tracer
        if tracer is None:
            return None
        return tracer.open(f"{request.method} {request.url.path}",
                           request.headers.get("traceparent"), arrived,
                           {"raging.prompt_tokens": prompt_tokens, "raging.choices": n})

    def _submit(self, tasks: list[GenerationTask], n: int, arrived: float,
                span: Span | None) -> list[RequestHandle]:
        """Each task's `n` choices, task by task (choice index = task * n + choice); when one
        cannot be routed, the ones already sent are aborted (and the span ends)."""
        dispatcher, tracer = self.state.dispatcher, self.state.tracer
        traceparent = "" if tracer is None or span is None else tracer.traceparent(span)
        handles: list[RequestHandle] = []
        try:
            for task in tasks:
                handles += dispatcher.submit_choices(task, n, arrived, traceparent)
        except APIError as exc:
            for handle in handles:
                dispatcher.abort(handle)
            if tracer is not None and span is not None:
                tracer.close(span, time.monotonic(), {"raging.outcome": "unavailable",
                                                      "http.response.status_code": exc.status})
            raise
        return handles


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


def client_request_id(request: Request) -> dict[str, str]:
    """The client's X-Request-Id to echo back, if it is a sane one. It is only echoed: the
    server names requests itself, so two requests with the same id never share state."""
    value = request.headers.get("x-request-id", "")
    if 0 < len(value) <= 128 and value.isascii() and value.isprintable():
        return {"X-Request-Id": value}
    return {}


