"""One /v1/messages reply: a chat reply's one choice, shown as an Anthropic Message whose
`content` holds text blocks and `tool_use` blocks, whole or as the Messages API's SSE events
(message_start, content_block_start, content_block_delta, content_block_stop, message_delta,
message_stop; `ping` while waiting; `error` when generation fails).

`ContentBlocks` builds the blocks from the chat shapes the reply already makes (text, tool-call
deltas), so tool calling and stop strings are the chat route's; each step returns the events it
causes, which the stream sends and a whole reply ignores.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.errors import APIError
from gateway.generation import KEEPALIVE, Generation
from gateway.reply import ChatFormat, Reply, WholeChoice, call_events
from gateway.state import GatewayState
from gateway.tools import ToolPlan, arguments_object

if TYPE_CHECKING:
    from opentelemetry.trace import Span

Event = dict[str, Any]  # one Messages stream event
PING_EVENT = 'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's keep-alive
# Chat's finish_reason -> Anthropic's stop_reason ("stop" by a stop string: stop_sequence).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@dataclass(frozen=True)
class AnthropicAsk:
    """What a Messages request asked beyond its chat request: `max_tokens`, which it may ask
    past the context (the reply stops at the context window instead, as Anthropic's do), and
    whether it turned `thinking` on (only then are thinking blocks shown)."""

    max_tokens: int | None
    thinking: bool = False


class ContentBlocks:
    """A reply's content blocks as they are made: text goes to a text block (opened at its
    first text), each tool call to a `tool_use` block of its own, its input streamed as JSON
    text; a block closes when another opens or the reply finishes."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open = False  # the last block still grows
        self.inputs: dict[int, str] = {}  # a tool_use block's index -> its input's JSON text

    def add_text(self, text: str) -> list[Event]:
        return self._add("text", text)

    def add_thinking(self, text: str) -> list[Event]:
        """Thinking (gateway/reasoning.py) goes to a thinking block, signed by no one."""
        return self._add("thinking", text)

    def _add(self, kind: str, text: str) -> list[Event]:
        """`text` added to the open block of `kind` (a text block's `text`, a thinking
        block's `thinking`), or to a new one."""
        if not text:
            return []
        events = [] if self._open_type() == kind else [*self._close(), *self._start(
            {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})]
        self.blocks[-1][kind] += text
        return [*events, self._delta({"type": f"{kind}_delta", kind: text})]

    def start_call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        """A tool_use block, its id Anthropic's spelling of the call's (`toolu_...`)."""
        tool_use_id = "toolu_" + call_id.removeprefix("call_")
        events = [*self._close(), *self._start({"type": "tool_use", "id": tool_use_id,
                                                "name": name, "input": {}})]
        self.inputs[len(self.blocks) - 1] = ""
        return events + self.add_arguments(arguments)

    def add_arguments(self, arguments: str) -> list[Event]:
        assert self._open_type() == "tool_use", "arguments follow their call's start"
        if not arguments:
            return []
        self.inputs[len(self.blocks) - 1] += arguments
        return [self._delta({"type": "input_json_delta", "partial_json": arguments})]

    def finish(self) -> list[Event]:
        return self._close()

    def content(self) -> list[dict[str, Any]]:
        """The blocks, each tool_use with its input as an object."""
        return [{**block, "input": arguments_object(self.inputs[index])} if index in self.inputs
                else dict(block) for index, block in enumerate(self.blocks)]

    def _open_type(self) -> str | None:
        return self.blocks[-1]["type"] if self.open else None

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self.blocks.append(block)
        self.open = True
        return [{"type": "content_block_start", "index": len(self.blocks) - 1,
                 "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


class MessagesReply(Reply):
    """A chat reply of one choice, shown as an Anthropic Message."""

    def __init__(self, generations: list[Generation], state: GatewayState, *, model: str,
                 timing: bool, span: Span | None, tools: ToolPlan | None,
                 in_thought: bool | None, ask: AnthropicAsk) -> None:
        assert len(generations) == 1, "a message has one reply"
        super().__init__(ChatFormat(), generations, state, include_usage=False, model=model,
                         timing=timing, span=span, tools=tools, in_thought=in_thought)
        self.id = f"msg_{generations[0].handle.request_id}"
        self.ask = ask
        self.blocks = ContentBlocks()
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    @property
    def route(self) -> str:
        return "messages"

    async def _events(self) -> AsyncIterator[str]:
        # message_start waits for the first event: by then the prompt is in, and its usage
        # (how much of it the cache held) agrees with message_delta's.
        started = False
        async for index, delta in self._deltas():
            if not started:
                started = True
                yield self._start_event()
            if delta is KEEPALIVE:
                yield PING_EVENT
                continue
            if delta.finish_reason == "error":
                self.outcome = "error"
                yield _sse(self.error_body(delta.error))
                return
            for event in self._choice_events(self._streamed_choice(index, delta) or {}):
                yield _sse(event)
        self.outcome = "ok"
        if not started:
            yield self._start_event()
        for event in self.blocks.finish():
            yield _sse(event)
        stop = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        ending: Event = {"type": "message_delta", "delta": stop, "usage": self._usage_fields()}
        if self.timing:
            ending["raging"] = self._raging(0)
        yield _sse(ending)
        yield _sse({"type": "message_stop"})

    def _start_event(self) -> str:
        return _sse({"type": "message_start", "message": self._message(streamed=True)})

    def _whole_body(self, wholes: list[WholeChoice]) -> dict[str, Any]:
        choice = self._whole_choice(0, wholes[0])
        message = choice["message"]
        if self.ask.thinking:
            self.blocks.add_thinking(message.get("reasoning", ""))
        self.blocks.add_text(message["content"] or "")
        for call in message.get("tool_calls", ()):
            self.blocks.start_call(call["id"], call["function"]["name"],
                                   call["function"]["arguments"])
        self._note_stop(choice)
        self.blocks.finish()
        return self._message(streamed=False)

    def error_body(self, message: str) -> dict[str, Any]:
        """A failure while the reply was made: Anthropic's `api_error` (its overloaded_error
        says to come back later; this is no such thing)."""
        return APIError(500, message, "server_error").to_anthropic_body()

    def _choice_events(self, choice: dict[str, Any]) -> Iterator[Event]:
        """A chat delta's events: its text, then its calls' starts and arguments."""
        if not choice:
            return
        delta = choice["delta"]
        if self.ask.thinking:
            yield from self.blocks.add_thinking(delta.get("reasoning", ""))
        yield from self.blocks.add_text(delta.get("content", ""))
        yield from call_events(delta, self.blocks)
        self._note_stop(choice)

    def _note_stop(self, choice: dict[str, Any]) -> None:
        reason, matched = choice["finish_reason"], choice["stop_reason"]
        if reason is None:
            return
        by_string = reason == "stop" and isinstance(matched, str)
        self.stop_reason = "stop_sequence" if by_string else _STOP_REASONS[reason]
        self.stop_sequence = matched if by_string else None
        allowed = self.generations[0].handle.task.max_tokens
        asked = self.ask.max_tokens  # a reply stopped short of it stopped at the window
        if reason == "length" and asked is not None and allowed < asked:
            self.stop_reason = "model_context_window_exceeded"

    def _message(self, streamed: bool) -> dict[str, Any]:
        """The Message: as the stream starts it (no content, no stop yet), or whole."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [] if streamed else self.blocks.content(),
                "stop_reason": None if streamed else self.stop_reason,
                "stop_sequence": None if streamed else self.stop_sequence,
                "usage": self._usage_fields()}

    def _usage_fields(self) -> dict[str, Any]:
        """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache."""
        usage = self._usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"] - cached,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                "output_tokens": usage["completion_tokens"]}


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
