"""One /v1/responses response: a chat reply's one choice, shown as a Response object whose
`output` holds a message item (the text) and function_call items, whole or as the Responses
API's typed SSE events (response.created, response.output_item.added,
response.output_text.delta, ..., response.completed); a reasoning model's thinking, where a
reasoning parser tells it apart, as a reasoning item (response.reasoning_text.delta, ...).

`OutputItems` builds the items from the chat shapes the reply already makes (text, tool-call
deltas), so tool calling, stop strings and logprobs are the chat route's; each step returns the
events it causes, which the stream sends and a whole response ignores.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gateway.background import EventLog
from gateway.generation import KEEPALIVE, Generation
from gateway.reply import KEEPALIVE_EVENT, ChatFormat, Reply, WholeChoice, call_events
from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses_request import ChatMessageFields, ResponsesRequest
from gateway.state import GatewayState
from gateway.tools import ToolPlan

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)
Event = dict[str, Any]  # one Responses stream event, before its sequence number
Status = Literal["completed", "incomplete"]


@dataclass(frozen=True)
class ResponseContext:
    """What a response echoes of its request, and where it is kept: `conversation` holds the
    chat messages before its output (the continued response's, then its input), `input_items`
    its own input as listed back, `owner` the tenant, `store` None when it is not kept."""

    request: ResponsesRequest
    conversation: list[ChatMessageFields]
    input_items: list[dict[str, Any]]
    owner: str
    store: ResponseStore | None
    temperature: float
    top_p: float


class OutputItems:
    """A response's output items as they are made: text goes to a message item (opened at its
    first text), each function call to an item of its own; an item closes when another opens
    or the response finishes (text after a call opens another message, with an id of its own:
    clients track items by id). Logprobs of tokens whose text is held back wait for the next
    text."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: int | None = None  # the index of the item still growing
        self.waiting_logprobs: list[dict[str, Any]] = []

    def add_text(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        if not text:
            self.waiting_logprobs += logprobs
            return []
        events = [] if self._open_type() == "message" else [*self._close(), *self._open_message()]
        logprobs, self.waiting_logprobs = [*self.waiting_logprobs, *logprobs], []
        part = self.items[-1]["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return [*events, {"type": "response.output_text.delta", **self._where(), "content_index": 0,
                          "delta": text, "logprobs": logprobs}]

    def add_reasoning(self, text: str) -> list[Event]:
        """Thinking (gateway/reasoning.py) goes to a reasoning item, opened at its first."""
        if not text:
            return []
        events = [] if self._open_type() == "reasoning" else [*self._close(),
                                                               *self._open_reasoning()]
        self.items[-1]["content"][0]["text"] += text
        return [*events, {"type": "response.reasoning_text.delta", **self._where(),
                          "content_index": 0, "delta": text}]

    def start_call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        events = self._close()
        item = {"type": "function_call", "id": f"fc_{secrets.token_hex(12)}",
                "call_id": call_id, "name": name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        self.open = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": self.open,
                       "item": copy.deepcopy(item)})
        return events + self.add_arguments(arguments)

    def add_arguments(self, arguments: str) -> list[Event]:
        assert self._open_type() == "function_call", "arguments follow their call's start"
        if not arguments:
            return []
        self.items[-1]["arguments"] += arguments
        return [{"type": "response.function_call_arguments.delta", **self._where(),
                 "delta": arguments}]

    def finish(self, status: Status) -> list[Event]:
        """Close the open item; a response with no output at all gets an empty message."""
        events = [] if self.items else self._open_message()
        return events + self._close(status)

    def _open_type(self) -> str | None:
        return None if self.open is None else self.items[self.open]["type"]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.items[self.open]["id"], "output_index": self.open}

    def _open_message(self) -> list[Event]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "in_progress",
                "role": "assistant", "content": [part]}
        self.items.append(item)
        self.open = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": self.open,
                 "item": {**item, "content": []}},
                {"type": "response.content_part.added", **self._where(), "content_index": 0,
                 "part": copy.deepcopy(part)}]

    def _open_reasoning(self) -> list[Event]:
        item = {"type": "reasoning", "id": f"rs_{secrets.token_hex(12)}", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        self.items.append(item)
        self.open = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": self.open,
                 "item": {**item, "content": []}}]

    def _close(self, status: Status = "completed") -> list[Event]:
        if self.open is None:
            return []
        where, item = self._where(), self.items[self.open]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **where, "content_index": 0,
                       "text": part["text"], "logprobs": part["logprobs"]},
                      {"type": "response.content_part.done", **where, "content_index": 0,
                       "part": copy.deepcopy(part)}]
        elif item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                       "text": item["content"][0]["text"]}]
        else:
            events = [{"type": "response.function_call_arguments.done", **where,
                       "name": item["name"], "arguments": item["arguments"]}]
        self.open = None
        return [*events, {"type": "response.output_item.done", "output_index": where[
            "output_index"], "item": copy.deepcopy(item)}]

    def as_message(self) -> ChatMessageFields:
        """The output as the assistant's chat message, for a later response to continue."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        message: ChatMessageFields = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        elif not text:
            message["content"] = ""
        return message


class ResponsesReply(Reply):
    """A chat reply of one choice, shown as a Response (`context` holds what it echoes)."""

    def __init__(self, context: ResponseContext, generations: list[Generation],
                 state: GatewayState, logprobs: bool, *, model: str, timing: bool,
                 span: Span | None, tools: ToolPlan | None, in_thought: bool | None) -> None:
        assert len(generations) == 1, "a response has one output"
        super().__init__(ChatFormat(), generations, state, include_usage=False,
                         logprobs=logprobs, model=model, timing=timing, span=span, tools=tools,
                         in_thought=in_thought)
        self.id = f"resp_{generations[0].handle.request_id}"
        self.context = context
        self.items = OutputItems()
        self.finish_reason: str | None = None
        self.sequence = itertools.count()
        self.kept_status: str | None = None  # the status last kept in the store

    @property
    def route(self) -> str:
        return "responses"

    async def _events(self) -> AsyncIterator[str]:
        if self.context.request.background:  # announced queued, as OpenAI's are
            yield self._sse({"type": "response.created", "response": self._response("queued")})
            yield self._sse({"type": "response.queued", "response": self._response("queued")})
        else:
            yield self._sse({"type": "response.created",
                             "response": self._response("in_progress")})
        yield self._sse({"type": "response.in_progress",
                         "response": self._response("in_progress")})
        async for index, delta in self._deltas():
            if delta is KEEPALIVE:
                yield KEEPALIVE_EVENT
                continue
            if delta.finish_reason == "error":
                self.outcome = "error"
                failed = self._failed(delta.error)
                yield self._sse({"type": "response.failed", "response": failed})
                return
            choice = self._streamed_choice(index, delta)
            for event in self._choice_events(choice or {}):
                yield self._sse(event)
        self.outcome = "ok"
        for event in self._finish():
            if self.timing and "response" in event:  # a whole response carries it too
                event = {**event, "response": {**event["response"], "raging": self._raging(0)}}
            yield self._sse(event)

    def _whole_body(self, wholes: list[WholeChoice]) -> dict[str, Any]:
        choice = self._whole_choice(0, wholes[0])
        message = choice["message"]
        self.items.add_reasoning(message.get("reasoning", ""))
        self.items.add_text(message["content"] or "", _logprob_entries(choice))
        for call in message.get("tool_calls", ()):
            self.items.start_call(call["id"], call["function"]["name"],
                                  call["function"]["arguments"])
        self.finish_reason = choice["finish_reason"]
        finished = list(self._finish())
        return finished[-1]["response"]

    def _choice_events(self, choice: dict[str, Any]) -> Iterator[Event]:
        """A chat delta's events: its text, then its calls' starts and arguments."""
        if not choice:
            return
        delta, logprobs = choice["delta"], _logprob_entries(choice)
        yield from self.items.add_reasoning(delta.get("reasoning", ""))
        if "reasoning" in delta and not delta.get("content"):
            logprobs = []  # the thinking's: no output_text shows them
        yield from self.items.add_text(delta.get("content", ""), logprobs)
        yield from call_events(delta, self.items)
        self.finish_reason = choice["finish_reason"] or self.finish_reason

    def _finish(self) -> Iterator[Event]:
        """The items' last events and the response's: completed, or incomplete when the
        output ran into its token limit; the response is kept, if asked."""
        status: Status = "incomplete" if self.finish_reason == "length" else "completed"
        yield from self.items.finish(status)
        response = self._response(status)
        self._keep(response)
        yield {"type": f"response.{status}", "response": response}

    def announce(self) -> dict[str, Any]:
        """A background response as its creation returns it: queued, and kept so."""
        response = self._response("queued")
        self._keep(response)
        return response

    async def in_background(self) -> None:
        """A background response's work: its output collected whole and kept as it ends
        (completed, incomplete or failed); cancelled, it is kept `cancelled`, and its request
        aborted on the workers."""
        outcome = "aborted"
        try:
            self._keep(self._response("in_progress"))
            wholes = await self._collect()
            if isinstance(wholes, str):
                outcome = "error"
                self._failed(wholes)
            else:
                outcome = "ok"
                self._whole_body(wholes)  # kept as it finishes
        except asyncio.CancelledError:
            self._keep(self._response("cancelled"))
            raise
        finally:
            self._close(outcome)

    async def streamed_in_background(self, log: EventLog) -> None:
        """A background stream's work: its events logged as they come (the stream that created
        it, and any later one, follows the log), the response kept as it goes and ends;
        cancelled, it is kept `cancelled`, its log ending there, and its request aborted on the
        workers."""
        self.outcome = "aborted"
        try:
            self._keep(self._response("in_progress"))
            async for event in self._events():
                if event != KEEPALIVE_EVENT:  # a follower makes its own
                    log.append(event)
        except asyncio.CancelledError:
            self._keep(self._response("cancelled"))
            raise
        finally:
            log.end()
            self._close(self.outcome)

    def settle(self, task: asyncio.Task[None], log: EventLog | None = None) -> None:
        """A background task's end, however it came. Its work settles everything itself,
        unless it was cancelled before its first step (its body never ran) or an error of
        ours ended it: then the response is kept cancelled or failed here, its log ended, and
        its request closed."""
        error = None if task.cancelled() else task.exception()
        if self.kept_status in ("queued", "in_progress"):
            if error is None:
                self._keep(self._response("cancelled"))
            else:
                logger.error("background response %s failed", self.id, exc_info=error)
                self._failed("the server failed while making this response")
        if log is not None and not log.ended:
            log.end()
        self._close("aborted" if error is None else "error")

    def _failed(self, message: str) -> dict[str, Any]:
        """The response failed, as its error says: kept so if it runs in the background (a
        foreground client is told by its reply)."""
        failed = self._response("failed", error={"code": "server_error", "message": message})
        if self.context.request.background:
            self._keep(failed)
        return failed

    def _keep(self, response: dict[str, Any]) -> None:
        context = self.context
        if context.store is None:
            return
        self.kept_status = response["status"]
        conversation = [*context.conversation, self.items.as_message()]
        context.store.keep(StoredResponse(context.owner, copy.deepcopy(response), conversation,
                                          context.input_items))

    def _sse(self, event: Event) -> str:
        event = {**event, "sequence_number": next(self.sequence)}
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object, with its output as it stands."""
        request, done = self.context.request, status in ("completed", "incomplete")
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "completed_at": int(time.time()) if done else None, "status": status,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if (
                status == "incomplete") else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.model, "output": copy.deepcopy(self.items.items) if done else [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.context.store is not None, "temperature": self.context.temperature,
            "top_p": self.context.top_p, "top_logprobs": request.top_logprobs or 0,
            "text": {"format": _text_format(request)}, "tool_choice": _tool_choice(request),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            "truncation": request.truncation or "disabled", "user": request.user,
            "metadata": request.metadata or {}, "background": bool(request.background),
            "usage": self._response_usage() if done else None}

    def _response_usage(self) -> dict[str, Any]:
        usage = self._usage()
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": usage.get("completion_tokens_details",
                                                   {"reasoning_tokens": 0}),
                "total_tokens": usage["total_tokens"]}


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]]:
    logprobs = choice["logprobs"]
    return [] if logprobs is None else list(logprobs["content"])


def _text_format(request: ResponsesRequest) -> dict[str, Any]:
    if request.text is None or request.text.format is None:
        return {"type": "text"}
    return request.text.format.model_dump(by_alias=True, exclude_none=True)


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
