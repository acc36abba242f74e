"""A Message's content blocks and the stream events each step makes, read back by the official
anthropic client's own accumulator (no workers needed: the whole reply is exercised end to end
in tests/e2e/test_messages.py)."""

from __future__ import annotations

from typing import Any

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import TextBlock, ThinkingBlock, ToolUseBlock

from gateway.messages_reply import ContentBlocks

START = {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3,
                                                         "output_tokens": 0}}}


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


def accumulated(events: list[dict[str, Any]]) -> list[Any]:
    """The content the anthropic client builds from `events`."""
    snapshot = None
    buffers: dict[int, bytes] = {}
    for event in [START, *events]:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot,  # type: ignore[arg-type]
                                    json_bufs=buffers)
    assert snapshot is not None
    return list(snapshot.content)


def test_text_opens_a_block_whose_deltas_add_up() -> None:
    blocks = ContentBlocks()
    first = blocks.add_text("Hel")
    assert kinds(first) == ["content_block_start", "content_block_delta"]
    assert first[0]["content_block"] == {"type": "text", "text": ""}
    assert blocks.add_text("") == []
    rest = blocks.add_text("lo") + blocks.finish()
    assert kinds(rest) == ["content_block_delta", "content_block_stop"]
    assert blocks.content() == [{"type": "text", "text": "Hello"}]
    [text] = accumulated(first + rest)
    assert isinstance(text, TextBlock) and text.text == "Hello"


def test_calls_close_the_text_and_stream_their_input_as_json() -> None:
    blocks = ContentBlocks()
    events = blocks.add_text("Looking.")
    started = blocks.start_call("call_1", "weather", '{"city"')
    assert kinds(started) == ["content_block_stop", "content_block_start",
                              "content_block_delta"]
    assert started[1]["index"] == 1 and started[1]["content_block"] == {
        "type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    assert started[2]["delta"] == {"type": "input_json_delta", "partial_json": '{"city"'}
    events += started + blocks.add_arguments(': "Paris"}')
    events += blocks.start_call("call_2", "weather", '{"city": "Rome"}') + blocks.finish()
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    content = blocks.content()
    assert content[1:] == [
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}}]
    text, first, second = accumulated(events)
    assert isinstance(text, TextBlock) and text.text == "Looking."
    assert isinstance(first, ToolUseBlock) and first.input == {"city": "Paris"}
    assert isinstance(second, ToolUseBlock) and second.id == "toolu_2"


def test_a_call_cut_off_mid_input_has_an_empty_input() -> None:
    blocks = ContentBlocks()
    blocks.start_call("call_1", "weather", '{"city": "Par')
    blocks.finish()
    assert blocks.content()[0]["input"] == {}


def test_nothing_said_is_no_block() -> None:
    blocks = ContentBlocks()
    assert blocks.finish() == [] and blocks.content() == []


def test_thinking_is_a_thinking_block_before_the_text() -> None:
    blocks = ContentBlocks()
    events = [*blocks.add_thinking("Two and "), *blocks.add_thinking("two."),
              *blocks.add_text("Four."), *blocks.finish()]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[1]["delta"] == {"type": "thinking_delta", "thinking": "Two and "}
    assert blocks.content() == [{"type": "thinking", "thinking": "Two and two.", "signature": ""},
                                {"type": "text", "text": "Four."}]
    thinking, text = accumulated(events)
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "Two and two."
    assert isinstance(text, TextBlock) and text.text == "Four."
