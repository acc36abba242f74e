"""One response of the OpenAI routes: its choices' text deltas as SSE chunks, or whole.

With n > 1, each choice is a `Generation` of its own; their deltas are merged as they come,
each chunk naming its choice by `index`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError
from gateway.generation import KEEPALIVE, Delta, Generation
from gateway.handle import Ending
from gateway.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from gateway.reasoning import Split, ThoughtSplitter
from gateway.state import GatewayState
from gateway.tools import Reason, ToolPlan, ToolStream

if TYPE_CHECKING:
    from opentelemetry.trace import Span

Logprobs = Sequence[TokenLogprob] | None  # None: the request did not ask for logprobs
CallFields = dict[str, Any] | None  # a chat message's or delta's tool_calls / function_call
StopReason = str | int | None  # vLLM's: the stop string or stop token id that ended a choice


class ChatFormat:
    """Shapes of /v1/chat/completions responses."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice_delta(self, index: int, text: str, reason: Reason | None, first: bool,
                     logprobs: Logprobs = None, stop_reason: StopReason = None,
                     calls: CallFields = None, reasoning: str = "") -> dict[str, Any]:
        """`calls`: the delta's `tool_calls` (or legacy `function_call`), if any;
        `reasoning`: its thinking (gateway/reasoning.py)."""
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if reasoning:  # under vLLM's name and under DeepSeek's, SGLang's and llama.cpp's
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if text and not first:
            delta["content"] = text
        delta.update(calls or {})
        shown = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": index, "delta": delta, "logprobs": shown, "finish_reason": reason,
                "stop_reason": stop_reason}

    def choice_full(self, index: int, text: str | None, reason: Reason | None,
                    logprobs: Logprobs = None, stop_reason: StopReason = None,
                    calls: CallFields = None, reasoning: str = "") -> dict[str, Any]:
        message = {"role": "assistant", "content": text, **(calls or {})}
        if reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        shown = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": index, "message": message, "logprobs": shown, "finish_reason": reason,
                "stop_reason": stop_reason}


class CompletionFormat:
    """Shapes of /v1/completions responses."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def choice_delta(self, index: int, text: str, reason: Reason | None, first: bool,
                     logprobs: Logprobs = None, stop_reason: StopReason = None,
                     calls: CallFields = None, reasoning: str = "") -> dict[str, Any]:
        assert calls is None and not reasoning, "no tools nor thinking on /v1/completions"
        shown = None if logprobs is None else completion_logprobs(logprobs)
        return {"index": index, "text": text, "logprobs": shown, "finish_reason": reason,
                "stop_reason": stop_reason}

    def choice_full(self, index: int, text: str | None, reason: Reason | None,
                    logprobs: Logprobs = None, stop_reason: StopReason = None,
                    calls: CallFields = None, reasoning: str = "") -> dict[str, Any]:
        assert text is not None
        return self.choice_delta(index, text, reason, first=False, logprobs=logprobs,
                                 stop_reason=stop_reason)


Format = ChatFormat | CompletionFormat


@dataclass
class WholeChoice:
    """A choice collected to its end."""

    parts: list[str] = field(default_factory=list)
    finish_reason: Ending | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_reason: StopReason = None
    token_ids: list[int] = field(default_factory=list)


class CallSteps(Protocol):
    """What a reply shown in another API's shape does with a chat delta's tool calls."""

    def start_call(self, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]: ...

    def add_arguments(self, arguments: str) -> list[dict[str, Any]]: ...


def call_events(delta: dict[str, Any], steps: CallSteps) -> Iterator[dict[str, Any]]:
    """The events of a chat delta's `tool_calls`: a call's start (its first delta carries its
    id), then its arguments as they come."""
    for call in delta.get("tool_calls", ()):
        function = call["function"]
        if "id" in call:
            yield from steps.start_call(call["id"], function["name"], function["arguments"])
        else:
            yield from steps.add_arguments(function["arguments"])


_ENDED = object()  # a choice's deltas are over
KEEPALIVE_EVENT = ": keepalive\n\n"  # an SSE comment: keeps a waiting stream's connection


class Reply:
    """One response, streamed as SSE chunks or returned whole; with `logprobs`, each choice
    carries the logprobs of its tokens; with `timing`, its latency breakdown (the chunk that
    ends a choice carries that choice's; a whole response, its first choice's). `model` is the
    name echoed (the one the request gave); `span`: the request's trace span, ended with the
    response."""

    media_type = "text/event-stream"  # of a stream

    def __init__(self, fmt: Format, generations: list[Generation], state: GatewayState,
                 include_usage: bool, logprobs: bool = False, choices_per_prompt: int = 1, *,
                 model: str | None = None, continuous_usage: bool = False,
                 timing: bool = False, span: Span | None = None,
                 tools: ToolPlan | None = None, in_thought: bool | None = None) -> None:
        assert generations and len(generations) % choices_per_prompt == 0
        prefix = "chatcmpl" if isinstance(fmt, ChatFormat) else "cmpl"
        self.id = f"{prefix}-{generations[0].handle.request_id}"
        self.fmt = fmt
        self.generations = generations
        self.state = state
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats
        self.logprobs = logprobs
        self.choices_per_prompt = choices_per_prompt
        self.timing = timing
        self.span = span
        self.created = int(time.time())
        self.model = model or state.model_name
        self.pumps: list[asyncio.Task[None]] = []  # one per choice, while deltas are read
        self.closed = False
        self.outcome = "aborted"  # of a stream, as it ends: ok, error or aborted
        # One per choice when its output may hold tool calls (gateway/tools.py).
        self.tool_streams = [tools.stream() for _ in generations] if tools else []
        # One per choice when its thinking is told from its answer (gateway/reasoning.py);
        # `in_thought`: whether an output opens in thought (None: no reasoning parser).
        self.in_thought = in_thought
        self.thoughts = [] if in_thought is None else [ThoughtSplitter(in_thought)
                                                        for _ in generations]

    async def _deltas(self) -> AsyncIterator[tuple[int, Delta | None]]:
        """Every choice's deltas (and KEEPALIVEs) as they come, with the choice's index."""
        gateway = self.state.config.gateway
        merged: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            async for delta in generation.deltas(gateway.keepalive_s,
                                                 gateway.progress_timeout_s):
                await merged.put((index, delta))
            await merged.put((index, _ENDED))

        self.pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        live = len(self.pumps)
        while live:
            index, item = await merged.get()
            if item is _ENDED:
                live -= 1
                continue
            assert item is None or isinstance(item, Delta)
            yield index, item

    @property
    def route(self) -> str:
        """The `route` label of the request's metrics."""
        return "chat" if isinstance(self.fmt, ChatFormat) else "completions"

    async def stream(self) -> AsyncIterator[str]:
        """The response as a stream (SSE events, or another API's lines: `media_type`); ends
        the request however the stream ends."""
        self.outcome = "aborted"
        try:
            async for event in self._events():
                yield event
        finally:
            self._close(self.outcome)

    async def _events(self) -> AsyncIterator[str]:
        """The SSE events; sets `outcome` as the stream ends well or in an error."""
        if isinstance(self.fmt, ChatFormat):  # the role chunk: usage so far is the prompt
            yield self._event([self.fmt.choice_delta(i, "", None, first=True)
                               for i in range(len(self.generations))],
                              self._usage() if self.continuous_usage else None)
        async for index, delta in self._deltas():
            if delta is KEEPALIVE:
                yield KEEPALIVE_EVENT
            elif delta.finish_reason == "error":
                self.outcome = "error"
                yield f"data: {json.dumps(self.error_body(delta.error))}\n\n"
                yield "data: [DONE]\n\n"  # as vLLM ends a failed stream: clients stop here
                return
            else:
                choice = self._streamed_choice(index, delta)
                if choice is not None:
                    yield self._event([choice],
                                      self._usage() if self.continuous_usage else None,
                                      self._raging(index) if delta.finish_reason else None)
        self.outcome = "ok"
        if self.include_usage:
            yield self._event([], usage=self._usage())
        yield "data: [DONE]\n\n"

    async def whole(self, request: Request) -> Response:
        """The complete response; a client that disconnects first aborts the request."""
        watcher = asyncio.create_task(wait_for_disconnect(request))
        collector = asyncio.create_task(self._collect())
        outcome = "aborted"
        try:
            done, _ = await asyncio.wait({watcher, collector},
                                         return_when=asyncio.FIRST_COMPLETED)
            if collector not in done:
                return Response(status_code=499)  # nobody is listening
            wholes = collector.result()
            if isinstance(wholes, str):
                outcome = "error"
                return JSONResponse(self.error_body(wholes), status_code=503,
                                    headers={"Retry-After": "1"})
            outcome = "ok"
            body = self._whole_body(wholes)
            if self.timing:
                body["raging"] = self._raging(0)
            return JSONResponse(body)
        finally:
            watcher.cancel()
            collector.cancel()
            self._close(outcome)

    def error_body(self, message: str) -> dict[str, Any]:
        """The body of a whole response that failed while it was made."""
        return APIError(503, message, "server_error", code="generation_failed").to_body()

    def _whole_body(self, wholes: list[WholeChoice]) -> dict[str, Any]:
        choices = [self._whole_choice(i, w) for i, w in enumerate(wholes)]
        return self._body(choices, usage=self._usage())

    def _tool_stream(self, index: int) -> ToolStream | None:
        return self.tool_streams[index] if self.tool_streams else None

    def _streamed_choice(self, index: int, delta: Delta) -> dict[str, Any] | None:
        """A delta's chunk choice; None when thinking or tool-call parsing holds all of it
        back."""
        logprobs = delta.logprobs if self.logprobs else None
        split = self._split(index, delta)
        tools = self._tool_stream(index)
        if tools is None:
            if self.thoughts and not (split.content or split.reasoning or delta.finish_reason
                                      or logprobs):
                return None  # a marker's start, held back
            return self.fmt.choice_delta(index, split.content, delta.finish_reason, False,
                                         logprobs, delta.stop_reason, reasoning=split.reasoning)
        output = tools.feed(split.content)
        reason: Reason | None = None
        if delta.finish_reason is not None:
            rest, reason = tools.finish(delta.finish_reason)
            output.extend(rest)
        if not (output.content or output.calls or reason or logprobs or split.reasoning):
            return None
        return self.fmt.choice_delta(index, output.content, reason, False, logprobs,
                                     delta.stop_reason, tools.message_fields(output),
                                     split.reasoning)

    def _split(self, index: int, delta: Delta) -> Split:
        """The delta's text as thinking and answer (all answer without a reasoning parser)."""
        if not self.thoughts:
            return Split(content=delta.text)
        split = self.thoughts[index].feed(delta.text)
        if delta.finish_reason is not None:
            split.extend(self.thoughts[index].finish())
        return split

    def _whole_choice(self, index: int, whole: WholeChoice) -> dict[str, Any]:
        logprobs = whole.logprobs if self.logprobs else None
        text = "".join(whole.parts)
        split = Split(content=text)
        if self.thoughts:
            split = self.thoughts[index].feed(text)
            split.extend(self.thoughts[index].finish())
        tools = self._tool_stream(index)
        if tools is None or whole.finish_reason is None:
            return self.fmt.choice_full(index, split.content, whole.finish_reason, logprobs,
                                        whole.stop_reason, reasoning=split.reasoning)
        content, calls, reason = tools.whole(split.content, whole.finish_reason)
        return self.fmt.choice_full(index, content, reason, logprobs, whole.stop_reason, calls,
                                    split.reasoning)

    async def _collect(self) -> list[WholeChoice] | str:
        """Every choice, once all have ended; or the error that ended one."""
        wholes = [WholeChoice() for _ in self.generations]
        async for index, delta in self._deltas():
            if delta is KEEPALIVE:
                continue
            if delta.finish_reason == "error":
                return delta.error
            wholes[index].parts.append(delta.text)
            wholes[index].logprobs.extend(delta.logprobs)
            wholes[index].token_ids.extend(delta.token_ids)
            wholes[index].finish_reason = delta.finish_reason
            wholes[index].stop_reason = delta.stop_reason
        assert all(w.finish_reason is not None for w in wholes), "each choice ends with one"
        return wholes

    def _raging(self, index: int) -> dict[str, Any] | None:
        """The `raging` field of choice `index`'s last chunk: its breakdown, when asked for."""
        if not self.timing:
            return None
        return {"timing": self.generations[index].handle.timing.breakdown()}

    def _close(self, outcome: str) -> None:
        """The request ends, once: its generations closed (aborted on the workers if still
        running), its outcome counted, its span ended."""
        if self.closed:
            return
        self.closed = True
        for task in self.pumps:
            task.cancel()
        for generation in self.generations:
            generation.close()
        self.state.metrics.requests.labels(self.route, outcome).inc()
        self._end_span(outcome)

    def _end_span(self, outcome: str) -> None:
        """The request's span ends, over a gateway.queue span per prompt."""
        tracer, span = self.state.tracer, self.span
        if tracer is None or span is None:
            return
        for generation in self.generations[::self.choices_per_prompt]:
            timing, handle = generation.handle.timing, generation.handle
            if timing.dispatched is not None:
                tracer.record("gateway.queue", span, timing.arrived, timing.dispatched,
                              {"raging.request_id": handle.request_id})
        tracer.close(span, time.monotonic(), {
            "raging.outcome": outcome, "raging.request_id": self.generations[0].handle.request_id,
            "raging.epoch": max(g.handle.epoch for g in self.generations),
            "raging.output_tokens": sum(g.completion_tokens for g in self.generations),
            "raging.prefill_worker": self.generations[0].handle.assignment.prefill_worker,
            "raging.decode_worker": self.generations[0].handle.assignment.decode_worker})

    def _usage(self) -> dict[str, Any]:
        """Each prompt counts once (it was prefilled once, whatever its choices); the choices'
        tokens add up."""
        firsts = self.generations[::self.choices_per_prompt]
        prompt = sum(g.prompt_tokens for g in firsts)
        completion = sum(g.completion_tokens for g in self.generations)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.handle.cached_tokens
                                                           for g in firsts)}}
        if self.thoughts:
            usage["completion_tokens_details"] = {"reasoning_tokens": self._reasoning_tokens()}
        return usage

    def _reasoning_tokens(self) -> int:
        """The choices' tokens spent thinking, so far."""
        return sum(generation.tokens_writing(thought.reasoning_chars)
                   for generation, thought in zip(self.generations, self.thoughts, strict=True))

    def _body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": self.fmt.object_name, "created": self.created,
                "model": self.model, "system_fingerprint": self.state.system_fingerprint,
                "choices": choices, "usage": usage}

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               raging: dict[str, Any] | None = None) -> str:
        """One SSE chunk; `usage` only on the last one, when the client asked for it; `raging`
        on the one that ends a choice, when the client asked for its timing."""
        chunk: dict[str, Any] = {"id": self.id, "object": self.fmt.chunk_object_name,
                                 "created": self.created, "model": self.model,
                                 "system_fingerprint": self.state.system_fingerprint,
                                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        if raging is not None:
            chunk["raging"] = raging
        return f"data: {json.dumps(chunk)}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
