"""The Messages request's schema (Anthropic's), and the chat request it means."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.messages_request import MessagesRequest, parse_messages_request

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def parse(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    return parse_messages_request(json.dumps({**body, **fields}).encode())


def refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(**fields).chat_request()
    assert caught.value.status == 400
    return caught.value


def test_system_blocks_and_text_blocks_become_chat_messages() -> None:
    chat = parse(system=[{"type": "text", "text": "Be brief."},
                         {"type": "text", "text": "Be kind.", "cache_control": {
                             "type": "ephemeral"}}],
                 messages=[{"role": "user", "content": [
                     {"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]}]
                 ).chat_request()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief.\nBe kind."), ("user", "Weather\nin Paris?")]
    assert chat.max_tokens == 64 and chat.add_generation_prompt
    assert not chat.continue_final_message


def test_calls_and_results_become_tool_calls_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather",
             "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}]},
            {"type": "text", "text": "Thanks!"}]}]
    chat = parse(messages=messages, tools=[WEATHER]).chat_request()
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool", "user"]
    turn = chat.messages[1]
    assert turn.content == "Let me look."
    assert [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in turn.tool_calls or []] == [("toolu_a", "get_weather", {"city": "Paris"}),
                                                ("toolu_b", "get_weather", {"city": "Rome"})]
    assert [(m.tool_call_id, m.content) for m in chat.messages[2:4]] == [
        ("toolu_a", "18 C"), ("toolu_b", "Error: no\ndata")]
    assert chat.messages[4].content == "Thanks!"
    [tool] = chat.tools or []
    assert tool.function.name == "get_weather"
    assert tool.function.parameters == WEATHER["input_schema"]


def test_a_turn_of_tool_results_alone_adds_no_user_message() -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name":
                                                   "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]
    chat = parse(messages=messages, tools=[WEATHER]).chat_request()
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].content is None and chat.messages[2].content == ""
    assert chat.add_generation_prompt


def test_a_last_assistant_message_is_continued_unless_it_is_empty() -> None:
    chat = parse(messages=[{"role": "user", "content": "Count to three."},
                           {"role": "assistant", "content": "One,"}]).chat_request()
    assert chat.continue_final_message and not chat.add_generation_prompt
    for empty in ("", [], [{"type": "thinking", "thinking": "hm", "signature": "s"}]):
        chat = parse(messages=[{"role": "user", "content": "Count to three."},
                               {"role": "assistant", "content": empty}]).chat_request()
        assert [m.role for m in chat.messages] == ["user"] and chat.add_generation_prompt


def test_consecutive_turns_of_a_role_are_merged() -> None:
    chat = parse(system="Be brief.", messages=[
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"}, {"role": "assistant", "content": "d"}]
    ).chat_request()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief.\nBe kind."), ("user", "a\nb"), ("assistant", "c\nd")]


@pytest.mark.parametrize(("choice", "chat_choice", "parallel"), [
    ({"type": "auto"}, "auto", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", None),
])
def test_tool_choices_map_to_chat_ones(choice: dict[str, Any], chat_choice: str,
                                       parallel: bool | None) -> None:
    chat = parse(tools=[WEATHER], tool_choice=choice).chat_request()
    assert chat.tool_choice == chat_choice and chat.parallel_tool_calls is parallel


def test_a_named_tool_choice_forces_that_function() -> None:
    chat = parse(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
                 ).chat_request()
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "get_weather"


def test_sampling_fields_stop_sequences_and_output_format_carry_over() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = parse(temperature=0.5, top_p=0.9, top_k=20, stop_sequences=["\n\n"], stream=True,
                 seed=7, output_config={"format": {"type": "json_schema", "schema": schema},
                                        "effort": "low"},
                 metadata={"user_id": "u"}, thinking={"type": "disabled"}).chat_request()
    assert (chat.temperature, chat.top_p, chat.top_k, chat.seed) == (0.5, 0.9, 20, 7)
    assert chat.stop == ["\n\n"] and chat.stream
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == schema


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]", "image input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]", "document input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": {}}]}]},
     "messages[0]", "only the assistant's messages may hold tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]",
     "content blocks must be"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]",
     "only custom tools"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice", "names the tool"),
    ({"n": 2}, "n", "n must be 1"),
    ({"response_format": {"type": "json_object"}}, "response_format", "output_config.format"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers",
     "not supported"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"output_format": {"type": "json_schema", "schema": {}},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, None, "not both"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Sure "}]}, None, "end with whitespace"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, None,
     "the last message calls tools"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": "and?"}]}, None, "not answered by tool_result blocks"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, None,
     "answer no tool_use"),
])
def test_what_is_refused_says_where_and_why(fields: dict[str, Any], param: str | None,
                                            words: str) -> None:
    with pytest.raises(APIError) as caught:
        parse(**fields)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message


def test_chat_errors_name_this_request_s_fields() -> None:
    error = refused(stop_sequences=[""])
    assert error.param == "stop_sequences" and "'stop_sequences'" in error.message
    error = refused(tool_choice={"type": "tool", "name": "missing"}, tools=[WEATHER])
    assert error.param == "tool_choice" and "missing" in error.message
    error = refused(tool_choice={"type": "any"})
    assert error.param == "tool_choice"


def test_an_empty_mcp_server_list_asks_for_nothing() -> None:
    assert parse(mcp_servers=[]).chat_request().messages[0].content == "Hi"
