"""A response's output items and the stream events each step makes (no workers needed: the
whole reply is exercised end to end in tests/e2e/test_responses.py)."""

from __future__ import annotations

from typing import Any

from openai import omit
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from gateway.responses_reply import OutputItems

LOGPROB = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"].removeprefix("response.") for event in events]


def test_text_opens_a_message_whose_deltas_add_up() -> None:
    items = OutputItems()
    first = items.add_text("Hel", [LOGPROB])
    assert kinds(first) == ["output_item.added", "content_part.added", "output_text.delta"]
    assert first[0]["item"]["content"] == [] and first[0]["item"]["status"] == "in_progress"
    assert kinds(items.add_text("lo", [])) == ["output_text.delta"]
    done = items.finish("completed")
    assert kinds(done) == ["output_text.done", "content_part.done", "output_item.done"]
    assert done[0]["text"] == "Hello" and done[0]["logprobs"] == [LOGPROB]
    assert done[2]["item"]["status"] == "completed"
    assert items.items == [done[2]["item"]]
    assert items.as_message() == {"role": "assistant", "content": "Hello"}


def test_a_call_closes_the_message_and_streams_its_arguments() -> None:
    items = OutputItems()
    items.add_text("Looking.", [])
    started = items.start_call("call_1", "weather", '{"city"')
    assert kinds(started) == ["output_text.done", "content_part.done", "output_item.done",
                              "output_item.added", "function_call_arguments.delta"]
    added = started[3]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert added["item"]["call_id"] == "call_1" and added["item"]["id"].startswith("fc_")
    items.add_arguments(': "Paris"}')
    second = items.start_call("call_2", "time", "{}")
    assert kinds(second)[:2] == ["function_call_arguments.done", "output_item.done"]
    assert second[0]["arguments"] == '{"city": "Paris"}' and second[0]["name"] == "weather"
    done = items.finish("incomplete")
    assert done[-1]["item"]["status"] == "incomplete"
    assert [item["type"] for item in items.items] == ["message", "function_call",
                                                      "function_call"]
    assert items.as_message() == {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}


def test_logprobs_of_held_back_text_wait_for_the_next_text() -> None:
    items = OutputItems()
    assert items.add_text("", [LOGPROB]) == []
    delta = items.add_text("b", [{**LOGPROB, "token": "b"}])[-1]
    assert [entry["token"] for entry in delta["logprobs"]] == ["a", "b"]


def test_an_output_of_nothing_is_an_empty_message() -> None:
    items = OutputItems()
    assert kinds(items.finish("completed")) == [
        "output_item.added", "content_part.added", "output_text.done", "content_part.done",
        "output_item.done"]
    assert items.as_message() == {"role": "assistant", "content": ""}


def test_an_output_of_calls_only_has_no_content() -> None:
    items = OutputItems()
    items.start_call("call_1", "f", "{}")
    items.finish("completed")
    assert items.as_message()["content"] is None


def test_text_after_a_call_is_another_message_with_an_id_of_its_own() -> None:
    """The openai client's stream accumulator tracks items by id: a repeated one breaks it."""
    items = OutputItems()
    items.add_text("First.", [])
    items.start_call("call_1", "f", "{}")
    again = items.add_text("Then.", [])
    items.finish("completed")
    first, _, second = items.items
    [added] = [e for e in again if e["type"] == "response.output_item.added"]
    assert first["id"] != second["id"] and added["item"]["id"] == second["id"]
    assert added["output_index"] == 2
    assert items.as_message()["content"] == "First.Then."


def completed_by_the_client(items: OutputItems, events: list[dict[str, Any]]) -> Any:
    """The response.completed event the official client's accumulator (what
    `client.responses.stream` runs) makes of `events` between created and completed."""
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
                "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "status": "in_progress"}
    state: ResponseStreamState[object] = ResponseStreamState(input_tools=omit, text_format=omit)
    lifecycle = [{"type": "response.created", "response": response}, *events,
                 {"type": "response.completed",
                  "response": {**response, "status": "completed", "output": items.items}}]
    handled = [state.handle_event(construct_type_unchecked(
        type_=ResponseStreamEvent,  # type: ignore[arg-type]  # a union, as the client passes it
        value={**event, "sequence_number": number})) for number, event in enumerate(lifecycle)]
    completed = handled[-1][-1]
    assert completed.type == "response.completed"
    return completed


def test_the_openai_clients_stream_state_takes_text_a_call_and_text_again() -> None:
    """The official client's accumulator (what `client.responses.stream` runs) reads these
    events to the same items; with one id for both messages it raised."""
    items = OutputItems()
    events = [*items.add_text("First.", []), *items.start_call("call_1", "f", '{"a": 1}'),
              *items.add_text("Then.", []), *items.finish("completed")]
    completed = completed_by_the_client(items, events)
    assert [item.type for item in completed.response.output] == [
        "message", "function_call", "message"]
    assert completed.response.output_text == "First.Then."


def test_thinking_is_a_reasoning_item_before_the_message() -> None:
    """As the official client accumulates it: a reasoning item with its reasoning_text, then
    the answer's message; the answer alone continues a later response."""
    items = OutputItems()
    events = [*items.add_reasoning("Two and "), *items.add_reasoning("two."),
              *items.add_text("Four.", []), *items.finish("completed")]
    assert kinds(events) == ["output_item.added", "reasoning_text.delta", "reasoning_text.delta",
                             "reasoning_text.done", "output_item.done", "output_item.added",
                             "content_part.added", "output_text.delta", "output_text.done",
                             "content_part.done", "output_item.done"]
    reasoning, message = items.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two and two."}]
    assert reasoning["id"].startswith("rs_") and message["type"] == "message"
    completed = completed_by_the_client(items, events)
    assert [item.type for item in completed.response.output] == ["reasoning", "message"]
    assert completed.response.output_text == "Four."
    assert items.as_message() == {"role": "assistant", "content": "Four."}
