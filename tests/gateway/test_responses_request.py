"""The Responses request's schema, and the chat request it means."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.responses_request import ResponsesRequest, parse_responses_request


def parse(**fields: Any) -> ResponsesRequest:
    return parse_responses_request(json.dumps({"model": "m", **fields}).encode())


def refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(**fields).chat_request([])
    assert caught.value.status == 400
    return caught.value


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat = parse(input="Hi", instructions="Be brief.").chat_request([])
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."),
                                                           ("user", "Hi")]


def test_items_become_messages_calls_and_tool_results() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text",
                                                                "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "noon"}]},
    ]
    earlier = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]
    chat = parse(input=items).chat_request(earlier)
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "developer", "user", "assistant", "tool", "tool"]
    assert chat.messages[3].content == "Weather\nin Paris?"
    turn = chat.messages[4]
    assert turn.content == "Let me look."
    assert [(c.id, c.function.name, c.function.arguments) for c in turn.tool_calls or []] == [
        ("call_a", "weather", '{"city": "Paris"}'), ("call_b", "time", "{}")]
    assert [(m.tool_call_id, m.content) for m in chat.messages[5:]] == [("call_a", "18 C"),
                                                                        ("call_b", "noon")]


def test_a_call_with_no_text_before_it_is_an_assistant_turn_of_its_own() -> None:
    items = [{"role": "user", "content": "Go"},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    turn = parse(input=items).chat_request([]).messages[-1]
    assert turn.role == "assistant" and turn.content is None and turn.tool_calls


def test_sampling_tools_format_and_logprobs_carry_over() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = parse(
        input="Hi", max_output_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=4,
        stop=["\n"], tools=[{"type": "function", "name": "f", "parameters": schema,
                             "strict": True}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        include=["message.output_text.logprobs", "reasoning.encrypted_content"],
        top_logprobs=2, reasoning={"effort": "low"}, store=False, metadata={"k": "v"},
        truncation="disabled").chat_request([])
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.top_k,
            chat.seed, chat.stop) == (7, 0.5, 0.9, 3, 4, ["\n"])
    assert chat.tools and chat.tools[0].function.name == "f"
    assert chat.tools[0].function.parameters == schema
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False
    assert chat.logprobs and chat.top_logprobs == 2


def test_without_include_there_are_no_logprobs() -> None:
    chat = parse(input="Hi", top_logprobs=3).chat_request([])
    assert not chat.logprobs and chat.top_logprobs is None


@pytest.mark.parametrize("text", [
    {"format": {"type": "json_object"}},
    {"format": {"type": "json_schema", "name": "point", "strict": True,
                "schema": {"type": "object", "properties": {"x": {"type": "number"}}}}},
])
def test_text_format_is_the_response_format(text: dict[str, Any]) -> None:
    chat = parse(input="Hi", text=text).chat_request([])
    assert chat.response_format is not None
    assert chat.response_format.type == text["format"]["type"]
    assert chat.response_format.grammar


@pytest.mark.parametrize(("fields", "says"), [
    ({"tools": [{"type": "web_search"}]}, "tools of type 'web_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "image input is not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input items must be"),
    ({"input": []}, "must not be empty"),
    ({"input": ""}, "must not be empty"),
    ({"background": True, "store": False}, "background needs store true"),
    ({"n": 2}, "n must be 1"),
    ({"response_format": {"type": "json_object"}}, "text.format"),
    ({"conversation": "conv_1"}, "not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "not supported"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice must be"),
    ({"tool_choice": "required"}, "no tools are given"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                   "name": "g"}},
     "not in tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs its name and schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_what_is_not_served_is_a_400_that_says_why(fields: dict[str, Any], says: str) -> None:
    error = refused(**{"input": "Hi", **fields})
    assert says in error.message, error.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "string", "pattern": "[a"}}}}, "text.format"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"user": "u" * 257}, "user"),
])
def test_a_400_names_the_field_of_this_request(fields: dict[str, Any], param: str) -> None:
    error = refused(**{"input": "Hi", **fields})
    assert error.param == param, error.message
    assert "response_format" not in error.message and "messages" not in error.message


def test_a_message_chat_would_refuse_is_a_400_on_input() -> None:
    earlier = [{"role": "tool", "content": "x"}]  # no tool_call_id
    with pytest.raises(APIError) as caught:
        parse(input="Hi").chat_request(earlier)
    assert caught.value.param == "input"


def test_a_background_response_is_accepted() -> None:
    assert parse(input="Hi", background=True).background


def test_input_items_are_listed_with_ids_statuses_and_content_parts() -> None:
    items = parse(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_mine", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "18 C"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]).input_items()
    user, assistant, call, output, reasoning = items
    assert user["id"].startswith("msg_") and len(user["id"]) == 28
    assert {k: v for k, v in user.items() if k != "id"} == {
        "type": "message", "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    assert assistant == {"id": "msg_mine", "type": "message", "role": "assistant",
                         "status": "completed",
                         "content": [{"type": "output_text", "text": "Let me look.",
                                      "annotations": []}]}
    assert call["id"].startswith("fc_") and call["call_id"] == "call_a"
    assert (call["name"], call["arguments"], call["status"]) == (
        "weather", '{"city": "Paris"}', "completed")
    assert output["id"].startswith("fco_") and output["output"] == "18 C"
    assert reasoning == {"id": "rs_1", "type": "reasoning", "summary": []}
    assert len({item["id"] for item in items}) == 5


def test_a_string_input_is_listed_as_one_user_message() -> None:
    [item] = parse(input="Hi").input_items()
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]
