"""Ollama's /api/chat and /api/generate bodies read as chat or completion requests: its
options, its formats, `think`, its unnamed calls and the tool messages that answer them; what
they cannot mean is a 400 naming Ollama's field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import APIError
from gateway.ollama_request import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    parse_ollama_chat,
    parse_ollama_generate,
)
from gateway.params import generation_params

HI = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> OllamaChatRequest:
    return parse_ollama_chat(json.dumps({"model": "m", "messages": HI, **fields}).encode())


def generate(**fields: Any) -> OllamaGenerateRequest:
    return parse_ollama_generate(json.dumps({"model": "m", "prompt": "Hi", **fields}).encode())


def refused(parse: Any, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(json.dumps(body).encode())
    assert caught.value.status == 400
    return caught.value


def test_options_are_the_chat_s_sampling() -> None:
    body = chat(options={"temperature": 0.5, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                         "seed": 7, "stop": ["\n\n"], "repeat_penalty": 1.2,
                         "presence_penalty": 0.1, "frequency_penalty": 0.2,
                         "num_predict": 12, "num_ctx": 4096, "num_gpu": 1})
    params = generation_params(body.chat_request())
    assert (body.settings.predict, params.temperature, params.top_k, params.top_p,
            params.min_p, params.seed, params.stop, params.repetition_penalty,
            params.presence_penalty, params.frequency_penalty) == (
        12, 0.5, 40, 0.9, 0.05, 7, ("\n\n",), 1.2, 0.1, 0.2)
    assert params.max_tokens is None  # num_predict is the cap the route sets, not a demand
    assert params.stream  # Ollama streams unless told not to
    assert not generation_params(chat(stream=False).chat_request()).stream


@pytest.mark.parametrize(("predict", "cap"), [(-1, None), (-2, None), (None, None), (5, 5)])
def test_num_predict_below_zero_is_up_to_the_cap(predict: int | None, cap: int | None) -> None:
    assert chat(options={"num_predict": predict}).settings.predict == cap


def test_a_top_p_of_zero_is_greedy() -> None:
    params = generation_params(chat(options={"top_p": 0}).chat_request())
    assert params.temperature == 0.0  # top_p left to the default, which greedy ignores


def test_format_is_json_or_a_schema() -> None:
    assert generation_params(chat(format="json").chat_request()).grammar is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = generation_params(chat(format=schema).chat_request()).grammar
    assert grammar is not None and json.loads(grammar.text)["properties"] == schema["properties"]
    assert generation_params(chat(format="").chat_request()).grammar is None


def test_think_sets_the_template_s_switch() -> None:
    assert chat(think=False).chat_request().chat_template_kwargs == {"enable_thinking": False}
    assert chat(think="high").chat_request().chat_template_kwargs == {"enable_thinking": True}
    assert chat().chat_request().chat_template_kwargs is None


def test_an_unnamed_call_is_answered_by_its_tool_s_message() -> None:
    body = chat(messages=[*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "time", "content": "noon"},
        {"role": "tool", "content": "sunny"}])
    messages = body.chat_request().messages
    calls = messages[1].tool_calls
    assert calls is not None and [call.id for call in calls] == ["call_1_0", "call_1_1"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert messages[1].content is None
    assert [m.tool_call_id for m in messages[2:]] == ["call_1_1", "call_1_0"]


def test_an_earlier_thought_goes_back_to_the_template() -> None:
    body = chat(messages=[*HI, {"role": "assistant", "content": "Hello", "thinking": "hm"}, *HI])
    assert body.chat_request().messages[1].reasoning_content == "hm"


def test_generate_renders_the_prompt_as_a_user_s_turn_or_raw() -> None:
    body = generate(system="be brief", options={"num_predict": 3})
    messages = body.chat_request().messages
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"), ("user", "Hi")]
    raw = generate(raw=True, logprobs=True, top_logprobs=2).completion_request()
    params = generation_params(raw)
    assert raw.prompt == ["Hi"] and params.max_tokens is None and params.logprobs == 2


def test_nothing_to_generate_and_keep_alive_zero_unloads() -> None:
    assert chat(messages=[]).messages == [] and generate(prompt="").prompt == ""
    assert chat(messages=[], keep_alive=0).unloads and generate(keep_alive="0s").unloads
    assert not chat(keep_alive="5m").unloads


@pytest.mark.parametrize(("parse", "body", "param"), [
    (parse_ollama_chat, {"messages": HI, "options": {"num_predict": 0}}, "options.num_predict"),
    (parse_ollama_chat, {"messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]},
     "messages[0].images"),
    (parse_ollama_chat, {"messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"function": {"name": "f"}}]}]}, "messages[0].tool_calls"),
    (parse_ollama_chat, {"messages": HI, "format": "yaml"}, "format"),
    (parse_ollama_generate, {"prompt": "Hi", "template": "{{ .Prompt }}"}, "template"),
    (parse_ollama_generate, {"prompt": "Hi", "images": ["aGk="]}, "images"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(parse: Any, body: dict[str, Any],
                                                         param: str) -> None:
    assert (refused(parse, body).param or "").startswith(param)


def test_a_suffix_is_not_for_a_raw_prompt() -> None:
    assert "suffix" in refused(parse_ollama_generate,
                               {"prompt": "Hi", "suffix": "end", "raw": True}).message
    for other in ({}, {"system": "Be brief."}, {"context": [1, 2]}):  # as Ollama takes them
        body = {"prompt": "Hi", "suffix": "end", **other}
        assert parse_ollama_generate(json.dumps(body).encode()).suffix == "end"


def test_chat_s_refusals_name_ollama_s_fields() -> None:
    with pytest.raises(APIError) as hot:
        chat(options={"temperature": 3}).chat_request()
    assert hot.value.param == "options.temperature"
    with pytest.raises(APIError) as stops:
        chat(options={"stop": [""]}).chat_request()
    assert stops.value.param == "options.stop"


def test_a_last_message_of_the_assistant_s_is_continued() -> None:
    request = chat(messages=[*HI, {"role": "assistant", "content": "Hel"}]).chat_request()
    assert request.continue_final_message and not request.add_generation_prompt
    assert chat().chat_request().add_generation_prompt


def test_a_seed_below_zero_is_a_fresh_one() -> None:
    assert generation_params(chat(options={"seed": -1}).chat_request()).seed is None
    assert generation_params(chat(options={"seed": 5}).chat_request()).seed == 5


def test_options_are_read_as_ollama_reads_them() -> None:
    """A whole number may come as a float; null fields are unset; roles in any case."""
    body = chat(options={"num_predict": 128.0, "num_ctx": 4096.0}, stream=None,
                logprobs=None, messages=[{"role": "User", "content": None}])
    assert body.settings.predict == 128
    request = body.chat_request()
    assert request.stream and request.messages[0].role == "user"
    assert request.messages[0].content == ""
    assert chat(options=None).settings.predict is None


def test_an_empty_system_is_none_and_raw_takes_no_system_nor_context() -> None:
    messages = generate(system="").chat_request().messages
    assert [m.role for m in messages] == ["user"]
    for extra in ({"system": "be brief"}, {"context": [1, 2]}):
        error = refused(parse_ollama_generate, {"prompt": "Hi", "raw": True, **extra})
        assert "raw mode" in error.message
