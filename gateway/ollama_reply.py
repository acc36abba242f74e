"""One reply of Ollama's `/api/chat` or `/api/generate`: a chat (or, for a raw prompt, a
completion) reply of one choice, shown as Ollama shows it. Streamed, it is newline-delimited
JSON: one object per piece of text (`message.content` or `response`, the thought in
`thinking`), the tool calls whole, in one object once they are complete (their `arguments` an
object), then one with `done: true`, `done_reason` and the counts and durations (in
nanoseconds). Whole, it is that last object with all the text. `/api/generate`'s last object
also carries `context`: the prompt's tokens and the reply's, for a next request to go on from.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gateway.generation import KEEPALIVE, Generation
from gateway.logprobs import TokenLogprob, chat_logprobs
from gateway.reply import Format, Reply, WholeChoice
from gateway.state import GatewayState, utc_text
from gateway.tools import ToolPlan, arguments_object

if TYPE_CHECKING:
    from opentelemetry.trace import Span

NDJSON = "application/x-ndjson"
_NS = 1_000_000_000
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


@dataclass(frozen=True)
class OllamaAsk:
    """Which of Ollama's routes answers (its text in `message.content` or in `response`), and
    for /api/generate the prompt's token ids, which start the `context` it returns."""

    route: Literal["chat", "generate"]
    arrived: float  # when the request came (time.monotonic()), where total_duration starts
    context: tuple[int, ...] = ()


@dataclass
class _Piece:
    """What one object of the reply says: its text, thought, tool calls and logprobs."""

    text: str = ""
    thinking: str = ""
    calls: list[dict[str, Any]] | None = None
    logprobs: Sequence[TokenLogprob] = ()


class CallCollector:
    """A reply's tool calls from chat's shapes (a delta's `tool_calls`, or a whole
    message's), as Ollama gives them: whole, their arguments an object."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # [id, name, arguments so far], as they come

    def feed(self, fields: dict[str, Any]) -> None:
        """A chat delta's or message's calls: a call's start carries its id, the deltas
        after it more of its arguments."""
        for call in fields.get("tool_calls", ()):
            function = call["function"]
            if "id" in call:
                self.calls.append([call["id"], function["name"], ""])
            self.calls[-1][2] += function["arguments"]

    def whole(self) -> list[dict[str, Any]] | None:
        """The calls so far (None: none)."""
        return [{"id": call_id, "function": {"index": index, "name": name,
                                             "arguments": arguments_object(arguments)}}
                for index, (call_id, name, arguments) in enumerate(self.calls)] or None


class OllamaReply(Reply):
    """A reply of one choice, in Ollama's shape."""

    media_type = NDJSON

    def __init__(self, fmt: Format, generations: list[Generation], state: GatewayState, *,
                 model: str, span: Span | None, tools: ToolPlan | None,
                 in_thought: bool | None, logprobs: bool, ask: OllamaAsk) -> None:
        assert len(generations) == 1, "an Ollama reply has one output"
        super().__init__(fmt, generations, state, include_usage=False, logprobs=logprobs,
                         model=model, span=span, tools=tools, in_thought=in_thought)
        self.ask = ask
        self.calls = CallCollector()
        self.done_reason = "stop"
        self.output_ids: list[int] = []

    @property
    def route(self) -> str:
        return f"ollama_{self.ask.route}"

    async def _events(self) -> AsyncIterator[str]:
        async for index, delta in self._deltas():
            if delta is KEEPALIVE:
                continue  # a JSON line would be a piece: nothing is sent while waiting
            if delta.finish_reason == "error":
                self.outcome = "error"
                yield _line(self.error_body(delta.error))
                return
            if self.ask.route == "generate":  # its context: the prompt's and these
                self.output_ids += delta.token_ids
            piece = self._streamed_piece(self._streamed_choice(index, delta) or {})
            piece.logprobs = delta.logprobs if self.logprobs else ()
            if piece.text or piece.thinking or piece.calls or piece.logprobs:
                yield _line(self._object(piece, done=False))
        self.outcome = "ok"
        yield _line(self._object(_Piece(), done=True))

    def _whole_body(self, wholes: list[WholeChoice]) -> dict[str, Any]:
        (whole,) = wholes
        self.output_ids = whole.token_ids
        choice = self._whole_choice(0, whole)
        self._note_end(choice["finish_reason"])
        fields = choice.get("message", choice)
        self.calls.feed(fields)
        piece = _Piece(fields.get("content") or fields.get("text") or "",
                       fields.get("reasoning", ""), self.calls.whole(),
                       whole.logprobs if self.logprobs else ())
        return self._object(piece, done=True)

    def error_body(self, message: str) -> dict[str, Any]:
        return {"error": message}

    def _streamed_piece(self, choice: dict[str, Any]) -> _Piece:
        """A chat or completion chunk's choice as a piece; its tool calls kept until the
        choice ends, then given whole."""
        if not choice:
            return _Piece()
        delta = choice.get("delta", choice)
        self.calls.feed(delta)
        piece = _Piece(delta.get("content") or delta.get("text") or "",
                       delta.get("reasoning", ""))
        if choice["finish_reason"] is not None:
            self._note_end(choice["finish_reason"])
            piece.calls = self.calls.whole()
        return piece

    def _note_end(self, finish_reason: str) -> None:
        self.done_reason = _DONE_REASONS[finish_reason]

    def _object(self, piece: _Piece, done: bool) -> dict[str, Any]:
        """One object of the reply; the last (`done`) with the counts and durations."""
        body: dict[str, Any] = {"model": self.model, "created_at": utc_text()}
        if self.ask.route == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": piece.text}
            if piece.thinking:
                message["thinking"] = piece.thinking
            if piece.calls:
                message["tool_calls"] = piece.calls
            body["message"] = message
        else:
            body["response"] = piece.text
            if piece.thinking:
                body["thinking"] = piece.thinking
        body["done"] = done
        if piece.logprobs:
            body["logprobs"] = chat_logprobs(piece.logprobs)["content"]
        if done:
            body.update(self._summary())
        return body

    def _summary(self) -> dict[str, Any]:
        generation = self.generations[0]
        prompt_s, output_s = generation.phases()
        count = generation.completion_tokens
        summary: dict[str, Any] = {
            "done_reason": self.done_reason,
            "total_duration": nanoseconds(time.monotonic() - self.ask.arrived),
            "load_duration": 0, "prompt_eval_count": generation.prompt_tokens,
            "prompt_eval_duration": nanoseconds(prompt_s), "eval_count": count,
            "eval_duration": nanoseconds(_output_seconds(prompt_s, output_s, count))}
        if self.ask.route == "generate":
            summary["context"] = [*self.ask.context, *self.output_ids]
        return summary


def loaded(model: str, route: Literal["chat", "generate"], unloaded: bool) -> dict[str, Any]:
    """The reply to a request with nothing to generate: Ollama's way to load a model (or,
    with keep_alive 0, to unload it). The workers hold it loaded either way."""
    body: dict[str, Any] = {"model": model, "created_at": utc_text()}
    if route == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return {**body, "done": True, "done_reason": "unload" if unloaded else "load"}


def nanoseconds(seconds: float) -> int:
    """A duration as Ollama gives them."""
    return int(seconds * _NS)


def _output_seconds(prompt_s: float, output_s: float, count: int) -> float:
    """`eval_duration`: `count` times the mean time between output tokens (a lone token, the
    prompt's phase that made it), so that eval_count over it is the rate."""
    if count <= 1:
        return prompt_s
    return output_s * count / (count - 1)


def _line(body: dict[str, Any]) -> str:
    return json.dumps(body) + "\n"
