"""Embeddings: a text's vector, as OpenAI's `POST /v1/embeddings` returns it here (Ollama's and
llama.cpp's routes ask the same `Embedder`).

A decoder's embedding of a text is its last token's final hidden state, as vLLM pools a decoder
it serves for embeddings. Each input runs as a prompt with one token to draw (greedy, never
shown) on whichever worker prefills it, which sends the hidden state with that token
(engine/pooling.py); the prefix cache serves it as any prompt. The vector is cut to the
`dimensions` asked for, then normalized (gateway/embedding_request.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from core.messages import GenerationTask, Sampling
from gateway.auth import cache_salt
from gateway.embedding_request import (
    EUCLIDEAN,
    UNNORMALIZED,
    EmbeddingRequest,
    base64_of,
    normalized,
    vector_of,
)
from gateway.errors import APIError, bad_request
from gateway.handle import RequestHandle
from gateway.openai_api import OpenAIRoutes
from gateway.prompts import render_chat_prompt
from gateway.reply import wait_for_disconnect
from gateway.validation import RequestModel, parse_body

if TYPE_CHECKING:
    from opentelemetry.trace import Span

WINDOW = 32  # a request's inputs in flight at once: a long list goes through in turns
Prompt = tuple[str | list[int], bool]  # an input, and whether its text gets special tokens
_Body = TypeVar("_Body", bound=RequestModel)
_Result = TypeVar("_Result")


class Embedder:
    """Vectors of prompts, over `routes`' admission and dispatch."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes
        self.state = routes.state

    async def body(self, request: Request, model: type[_Body]) -> _Body:
        """The request's body as `model`, read off the event loop (a list of 2,048 inputs
        takes a while), its unknown fields noted or refused."""
        data = await self.routes.read_body(request)
        body = await asyncio.to_thread(parse_body, model, data)
        self.routes.ignored.check(body)
        return body

    async def token_ids(self, inputs: Sequence[str | list[int]], special: bool = True
                        ) -> list[list[int]]:
        """Each input's token ids (a text tokenized, given ids checked)."""
        return [await self.routes.tokenize_with(_token_ids, (text, special)) for text in inputs]

    def room(self) -> int:
        """The most tokens an input may have: the context, less the token drawn after it."""
        return self.routes.context_limit() - 1

    def size(self, dimensions: int | None) -> int:
        """The vector's length a request asks for: its first `dimensions` values (as a
        Matryoshka model's are read), at most the model's hidden size."""
        hidden = self.hidden_size
        if dimensions is not None and dimensions > hidden:
            raise bad_request(f"dimensions must be at most {hidden}, the model's hidden size",
                              param="dimensions")
        return dimensions or hidden

    @property
    def hidden_size(self) -> int:
        facts = self.state.facts
        assert facts is not None, "the app's state has the model's facts"
        return facts.spec.hidden_size

    async def vectors(self, request: Request, route: str, prompts: list[list[int]],
                      arrived: float, priority: int = 0) -> list[np.ndarray]:
        """Each prompt's vector as the model leaves it (not normalized); a 400 for a prompt
        that is empty or longer than `room()`, the admission's 429 or 503 (each window of
        inputs is admitted as it goes out), a 503 when a worker fails one; a client gone
        first aborts them all (ClientDisconnect). `arrived`: when the HTTP request came in,
        before its body was read and its inputs tokenized."""
        await self.state.dispatcher.until_decode_serves()
        self._check_lengths(prompts)
        salt = cache_salt(request)
        tasks = [_embedding_task(ids, salt, priority) for ids in prompts]
        span = self.routes.open_span(request, arrived, {
            "raging.prompt_tokens": sum(len(ids) for ids in prompts),
            "raging.inputs": len(prompts)})
        sent = _Sent(arrived, self._traceparent(span))
        self.state.metrics.inflight.inc()
        outcome = "aborted"
        try:
            vectors = await _unless_gone(request, self._all(tasks, sent))
            outcome = "ok"
            return vectors
        except APIError:  # refused before any input went out: as chat's, never counted
            outcome = "error" if sent.first_request_id else "unavailable"
            raise
        finally:
            self.state.metrics.inflight.dec()
            if outcome != "unavailable":
                self.state.metrics.requests.labels(route, outcome).inc()
            self._end_span(span, outcome, sent)

    def _traceparent(self, span: Span | None) -> str:
        tracer = self.state.tracer
        return "" if tracer is None or span is None else tracer.traceparent(span)

    def _end_span(self, span: Span | None, outcome: str, sent: _Sent) -> None:
        tracer = self.state.tracer
        if tracer is None or span is None:
            return
        named = {"raging.request_id": sent.first_request_id} if sent.first_request_id else {}
        tracer.close(span, time.monotonic(), {"raging.outcome": outcome, **named})

    def _check_lengths(self, prompts: list[list[int]]) -> None:
        room = self.room()
        for index, ids in enumerate(prompts):
            if not ids:
                raise bad_request(f"input {index} is empty: it must have at least one token",
                                  param="input")
            if len(ids) > room:
                raise bad_request(
                    f"This model's maximum context length is {room + 1} tokens. However, you "
                    f"requested {len(ids)} tokens in the input for embedding generation. "
                    "Please reduce the length of the input.",
                    param="input", code="context_length_exceeded")

    async def _all(self, tasks: list[GenerationTask], sent: _Sent) -> list[np.ndarray]:
        vectors: list[np.ndarray] = []
        for start in range(0, len(tasks), WINDOW):
            vectors += await self._window(tasks[start:start + WINDOW], sent)
        return vectors

    async def _window(self, tasks: list[GenerationTask], sent: _Sent) -> list[np.ndarray]:
        """The tasks' vectors, admitted and sent together (nothing awaited in between, so
        that no other request slips past the same admission), then all in flight at once;
        any left unfinished (one failed, the client left) are aborted."""
        dispatcher = self.state.dispatcher
        self.routes.admit(sum(len(task.prompt_ids) for task in tasks))
        handles: list[RequestHandle] = []
        waits: list[asyncio.Future[np.ndarray]] = []
        endings: dict[str, str] = {}  # request id -> how it ended, once it has
        try:
            for task in tasks:
                handles += dispatcher.submit_choices(task, 1, sent.arrived, sent.traceparent)
            sent.first_request_id = sent.first_request_id or handles[0].request_id
            self.state.metrics.prompt_tokens.inc(sum(len(task.prompt_ids) for task in tasks))
            waits = [asyncio.ensure_future(self._vector(handle, endings)) for handle in handles]
            return list(await asyncio.gather(*waits))
        finally:
            for wait in waits:
                wait.cancel()
            for handle in handles:  # each sent input counted once, as vLLM counts its ends
                dispatcher.abort(handle)
                self.state.metrics.vllm.finished(endings.get(handle.request_id, "abort"),
                                                 len(handle.task.prompt_ids), 0, None)

    async def _vector(self, handle: RequestHandle, endings: dict[str, str]) -> np.ndarray:
        """The handle's vector; `endings` says how it ended ("stop" once its vector came,
        "error" when it failed; left out: aborted, as the client left or another failed)."""
        try:
            vector = await self._received_vector(handle)
        except APIError:
            endings[handle.request_id] = "error"
            raise
        endings[handle.request_id] = "stop"
        metrics = self.state.metrics
        metrics.e2e.observe(time.monotonic() - handle.timing.arrived)
        metrics.vllm.prefilled(len(handle.task.prompt_ids), handle.cached_tokens)
        return vector

    async def _received_vector(self, handle: RequestHandle) -> np.ndarray:
        timeout = self.state.config.gateway.progress_timeout_s
        try:
            event = await asyncio.wait_for(handle.events.get(), timeout)
        except TimeoutError:
            raise _failed("the request made no progress in time") from None
        if event.token_id is None:
            raise _failed(event.error)
        try:
            vector = vector_of(event.embedding)
        except ValueError as exc:
            raise _failed(str(exc)) from None
        return vector


@dataclass
class _Sent:
    """What every input of one request goes out with: the request's arrival and its span's
    traceparent; and the first input's id, which names the request's span."""

    arrived: float
    traceparent: str
    first_request_id: str = ""


class EmbeddingRoutes:
    """`POST /v1/embeddings`, OpenAI's (and vLLM's)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self.routes = embedder.routes

    async def embeddings(self, request: Request) -> Response:
        arrived = time.monotonic()
        body = await self.embedder.body(request, EmbeddingRequest)
        model = self.routes.served_model(body.model)
        size = self.embedder.size(body.dimensions)
        prompts = await self._prompts(body)
        keep = body.truncate_prompt_tokens
        if keep is not None:  # vLLM's: the last tokens
            keep = self.embedder.room() if keep == -1 else keep
            prompts = [ids[-keep:] if keep else [] for ids in prompts]
        vectors = await self.embedder.vectors(request, "embeddings", prompts, arrived,
                                              body.priority)
        norm = EUCLIDEAN if body.normalize else UNNORMALIZED
        tokens = sum(len(ids) for ids in prompts)

        def reply() -> dict[str, Any]:
            data = [{"object": "embedding", "index": index, "embedding": _encoded(
                normalized(vector[:size], norm), body.encoding_format)}
                for index, vector in enumerate(vectors)]
            return {"id": f"embd-{uuid.uuid4().hex}", "object": "list",
                    "created": int(time.time()), "model": model, "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        return await json_reply(reply)

    async def _prompts(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids; or the messages' under the chat template, one prompt."""
        if body.messages is None:
            assert body.input is not None, "one of them, as the body was read"
            return await self.embedder.token_ids(body.input, body.special_tokens)
        render = functools.partial(render_chat_prompt, options=body.template)
        return [await self.routes.tokenize_with(render, body.messages)]


async def json_reply(make: Callable[[], object]) -> Response:
    """`make()`'s JSON, made and written off the event loop (2,048 vectors of 4,096 values take
    seconds, which no other client's stream should wait for), as JSONResponse writes it."""
    def render() -> bytes:
        return json.dumps(make(), ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8")

    return Response(await asyncio.to_thread(render), media_type="application/json")


def _token_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    text, special = prompt
    if isinstance(text, str):
        return list(tokenizer.encode(text, add_special_tokens=special))
    vocab = len(tokenizer)
    if any(token >= vocab for token in text):
        raise bad_request(f"input token ids must be below {vocab}", param="input")
    return list(text)


def _embedding_task(prompt_ids: list[int], salt: str, priority: int) -> GenerationTask:
    """A prompt whose embedding is asked for: one token drawn after it, greedily."""
    return GenerationTask(prompt_ids=prompt_ids, sampling=Sampling(temperature=0.0),
                          max_tokens=1, stop_token_ids=[], ignore_eos=True, cache_salt=salt,
                          priority=priority, embedding=True)


async def _unless_gone(request: Request, work: Awaitable[_Result]) -> _Result:
    """`work`'s result, unless the client disconnects first (then it is cancelled, and its
    requests aborted)."""
    watcher = asyncio.create_task(wait_for_disconnect(request))
    worker = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({watcher, worker}, return_when=asyncio.FIRST_COMPLETED)
        if worker not in done:
            raise ClientDisconnect
        return worker.result()
    finally:
        watcher.cancel()
        worker.cancel()


def _failed(reason: str) -> APIError:
    return APIError(503, reason, "server_error", code="embedding_failed")


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64_of(vector)
    values: list[float] = vector.tolist()
    return values
