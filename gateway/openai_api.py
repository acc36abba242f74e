"""The OpenAI routes: /v1/chat/completions, /v1/completions (streaming and not), /v1/models."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


class OpenAIRoutes:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.pieces = TokenPieces(state.tokenizer)

    async def chat_completions(self, request: Request) -> Response:
        # Off the loop: a response_format's schema is checked with xgrammar, slow the first time.
        body = await asyncio.to_thread(parse_chat_request, await self._read_body(request))
        self._check_model(body.model)
        prompt_ids = await self._tokenize(render_chat_prompt, body.messages)
        return await self._serve(request, ChatFormat(), [prompt_ids], generation_params(body))

    async def completions(self, request: Request) -> Response:
        body = await asyncio.to_thread(parse_completion_request, await self._read_body(request))
        self._check_model(body.model)
        prompts = [await self._tokenize(tokenize_prompt, prompt) for prompt in body.prompt]
        return await self._serve(request, CompletionFormat(), prompts, generation_params(body))

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
                     params: GenerationParams) -> Response:
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
        handles = self._submit(tasks, params.n)
        self.state.metrics.prompt_tokens.inc(prompt_tokens)
        logprobs = params.logprobs is not None
        generations = [Generation(handle, self.state.dispatcher.abort, self.state.metrics,
                                  self.state.tokenizer, params.stop,
                                  self.pieces if logprobs else None) for handle in handles]
        reply = Reply(fmt, generations, self.state, params.include_usage, logprobs, params.n)
        echoed = client_request_id(request)
        if params.stream:
            return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **echoed})
        response = await reply.whole(request)
        response.headers.update(echoed)
        return response

    def _submit(self, tasks: list[GenerationTask], n: int) -> list[RequestHandle]:
        """Each task's `n` choices, task by task (choice index = task * n + choice); when one
        cannot be routed, the ones already sent are aborted."""
        dispatcher = self.state.dispatcher
        handles: list[RequestHandle] = []
        try:
            for task in tasks:
                handles += dispatcher.submit_choices(task, n)
        except APIError:
            for handle in handles:
                dispatcher.abort(handle)
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


