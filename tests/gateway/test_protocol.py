"""Request parsing and validation of gateway.protocol."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.chat_request import parse_chat_request
from gateway.errors import (
    APIError,
)
from gateway.ignored_fields import unknown_fields
from gateway.params import generation_params
from gateway.protocol import parse_completion_request

MESSAGES = [{"role": "user", "content": "Hello!"}]
LONG = "Z" * 50_000
TOOL_F = {"type": "function", "function": {"name": "f"}}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "Once upon a time", **fields}).encode()


def raises_400(parse: Any, body: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    body_json = err.to_body()
    assert set(body_json) == {"error"}
    assert set(body_json["error"]) == {"message", "type", "param", "code"}
    assert body_json["error"]["type"] == "invalid_request_error"
    assert body_json["error"]["message"]
    return err


BAD_BODIES: list[tuple[bytes, str | None]] = [
    (b"", None),
    (b"null", None),
    (b"x", None),
    (b"[]", None),
    (b"42", None),
    (b'"messages"', None),
    (b'{"model": "m", "messages": [', None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    (b"\xff\xfe\x00", None),
    (b'{"model": "m"}', "messages"),
    (chat(model=7), "model"),
    (chat(messages=[]), "messages"),
    (chat(messages=None), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0]"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "input_audio"}]}]),
     "messages[0].content[1]"),
    (chat(messages=[{"role": "user", "content": [{"type": "file", "file": {}}]}]),
     "messages[0].content[0]"),
    (chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": ["text"]}]), "messages[0].content"),
    (chat(messages=[MESSAGES[0], {"role": "user", "content": 1}]), "messages[1].content"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=-5), "max_tokens"),
    (chat(max_tokens=1.5), "max_tokens"),
    (chat(max_tokens="10"), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature=2.5), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat().replace(b'"model"', b'"temperature": NaN, "model"'), "temperature"),
    (chat().replace(b'"model"', b'"temperature": Infinity, "model"'), "temperature"),
    (chat().replace(b'"model"', b'"top_p": 1e400, "model"'), "top_p"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(top_k=-2), "top_k"),
    (chat(n=0), "n"),
    (chat(n=-1), "n"),
    (chat(n=17), "n"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (chat(stop=5), "stop"),
    (chat(stop=[""]), "stop"),
    (chat(stop=""), "stop"),
    (chat(stop=["a", 1]), "stop"),
    (chat(stop=[str(i) for i in range(17)]), "stop"),
    (chat(stop="s" * 1001), "stop"),
    (chat(stop_token_ids=[-1]), "stop_token_ids[0]"),
    (chat(stop_token_ids=list(range(65))), "stop_token_ids"),
    (chat(seed="x"), "seed"),
    (chat(seed=2**70), "seed"),
    (chat(ignore_eos=1), "ignore_eos"),
    (chat(presence_penalty=2.5), "presence_penalty"),
    (chat(frequency_penalty=-3), "frequency_penalty"),
    (chat(logprobs=1), "logprobs"),
    (chat(top_logprobs=3), "top_logprobs"),  # without logprobs: true
    (chat(logprobs=False, top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters"),
    (chat(tools=[TOOL_F, TOOL_F]), "tools"),
    (chat(tools=[TOOL_F], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice"),
    (chat(tools=[TOOL_F], tool_choice={"type": "function"}), "tool_choice"),
    (chat(tools=[TOOL_F], tool_choice="always"), "tool_choice"),
    (chat(tools=[TOOL_F], functions=[{"name": "f"}]), "functions"),
    (chat(functions=[{"name": "f"}], tool_choice="auto", function_call={"name": "f"}),
     "function_call"),
    (chat(functions=[{"name": "f"}], function_call={"name": "g"}), "function_call"),
    (chat(functions=[{"name": "f"}], function_call="required"), "function_call"),
    (chat(tools=[TOOL_F], tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string", "pattern": "[a"}}}], tool_choice="required"), "tools"),
    (chat(messages=[{"role": "tool", "content": "42"}]), "messages[0]"),
    (chat(messages=[{"role": "user", "content": "hi", "tool_calls": [TOOL_CALL]}]),
     "messages[0]"),
    (chat(messages=[{"role": "assistant", "content": None}]), "messages[0].content"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "function", "content": "42"}]), "messages[0]"),
    (chat(user=5), "user"),
    (chat(metadata={"k": 1}), "metadata.k"),
    (chat(logit_bias={"-5": 5}), "logit_bias"),
    (chat(logit_bias={"5": -100.5}), "logit_bias.5"),
    (chat(logit_bias={"5": "up"}), "logit_bias.5"),
    (chat(tool_choice="required"), "tool_choice"),  # no tools to call
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (chat(tool_choice=3), "tool_choice"),
    (chat(modalities=["text", "audio"]), "modalities"),
    (chat(audio={"voice": "x", "format": "mp3"}), "audio"),
    (chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (chat(web_search_options={}), "web_search_options"),
    (chat(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]),
     "messages[0].tool_calls[0].type"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{**TOOL_CALL, "function": {
        "name": "f", "arguments": {"x": 1}}}]}]), "messages[0].tool_calls[0].function.arguments"),
    (chat(min_tokens=-1), "min_tokens"),
    (chat(min_tokens=1.5), "min_tokens"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(repetition_penalty=-1.2), "repetition_penalty"),
    (chat(repetition_penalty="1.2"), "repetition_penalty"),
    (chat(top_k=2**31), "top_k"),
    # vLLM's extensions
    (chat(min_p=-0.1), "min_p"),
    (chat(min_p=1.5), "min_p"),
    (chat(min_p="0.1"), "min_p"),
    (chat(repeat_penalty=0), "repeat_penalty"),
    (chat(repeat_penalty=1.1, repetition_penalty=1.2), None),
    (chat(skip_special_tokens="no"), "skip_special_tokens"),
    (chat(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (chat(allowed_token_ids=[]), "allowed_token_ids"),
    (chat(allowed_token_ids=[1, -2]), "allowed_token_ids[1]"),
    (chat(allowed_token_ids="1"), "allowed_token_ids"),
    (chat(bad_words="bad"), "bad_words"),
    (chat(bad_words=[" "]), "bad_words"),
    (chat(bad_words=["w"] * 65), "bad_words"),
    (chat(bad_words=["x" * 1001]), "bad_words"),
    (chat(priority=1.5), "priority"),
    (chat(tools=[TOOL_F], tool_choice="required", guided_regex="x"), "tool_choice"),
    (chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
    (chat(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    (chat(add_generation_prompt="yes"), "add_generation_prompt"),
    (chat(continue_final_message=True), None),  # add_generation_prompt is true by default
    (chat(continue_final_message=True, add_generation_prompt=False), None),  # last is the user's
]

BAD_COMPLETIONS: list[tuple[bytes, str | None]] = [
    (json.dumps({"model": "m"}).encode(), "prompt"),
    (completion(prompt=None), "prompt"),
    (completion(prompt=5), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[[]]), "prompt"),
    (completion(prompt=["a", [1], []]), "prompt"),
    (completion(prompt=["a"] * 9, n=2), None),  # 18 choices in all
    (completion(prompt=[[[1]]]), "prompt"),
    (completion(prompt=[1, "a"]), "prompt"),
    (completion(prompt=[1, True]), "prompt"),
    (completion(prompt=[1.5]), "prompt"),
    (completion(prompt={"text": "x"}), "prompt"),
    (completion(max_tokens=0), None),  # without echo
    (completion(echo=True, max_tokens=-1), "max_tokens"),
    (completion(best_of=2), "best_of"),
    (completion(prompt=[1, 2], suffix="tail"), "suffix"),  # a suffix follows text
    (completion(echo=True, suffix="tail"), "suffix"),
    (completion(logprobs=6), "logprobs"),
    (completion(logprobs=-1), "logprobs"),
    (completion(logprobs=True), "logprobs"),
    (completion(n=17), "n"),
    (completion(temperature=3), "temperature"),
    (completion(logit_bias={"1.5": -100}), "logit_bias"),
    (completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_bad_chat_bodies_are_400(body: bytes, param: str | None) -> None:
    err = raises_400(lambda b: generation_params(parse_chat_request(b)), body)
    assert err.param == param
    if param is not None:
        assert param in err.message


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_bodies_are_400(body: bytes, param: str | None) -> None:
    err = raises_400(lambda b: generation_params(parse_completion_request(b)), body)
    assert err.param == param


def test_unsupported_features_say_so() -> None:
    assert "n must be at most 16" in raises_400(parse_chat_request, chat(n=17)).message
    assert "needs echo" in raises_400(parse_completion_request, completion(max_tokens=0)).message
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    err = raises_400(parse_chat_request, chat(messages=[{"role": "user", "content": image}]))
    assert "text" in err.message
    err = raises_400(parse_completion_request, completion(prompt=["a"] * 9, n=2))
    assert "prompts times n must be at most 16" in err.message
    err = raises_400(parse_completion_request, completion(prompt=[1, 2], suffix="tail"))
    assert "a suffix follows a text prompt" in err.message
    err = raises_400(parse_completion_request, completion(echo=True, suffix="tail"))
    assert "echo shows the prompt" in err.message


@pytest.mark.parametrize(("fields", "known", "where"), [
    ({"temprature": 0.5}, {}, "temprature"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]},
     {"messages": [{"role": "user", "content": "hi"}]}, "messages[0].colour"),
    ({"stream": True, "stream_options": {"include_usage": True, "cached_usage_stats": True}},
     {"stream": True, "stream_options": {"include_usage": True}},
     "stream_options.cached_usage_stats"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": "b", "x": 1}]}]},
     {"messages": [{"role": "user", "content": "a\nb"}]}, "messages[0].content[1].x"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "extra": 1}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format.json_schema.extra"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]},
     {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.colour"),
    ({"raging": {"timing": True, "timings": True}}, {"raging": {"timing": True}},
     "raging.timings"),
])
def test_unknown_fields_are_accepted_and_found(fields: dict[str, Any], known: dict[str, Any],
                                               where: str) -> None:
    req, plain = parse_chat_request(chat(**fields)), parse_chat_request(chat(**known))
    assert unknown_fields(req) == [where]
    assert unknown_fields(plain) == []
    assert generation_params(req) == generation_params(plain)
    assert [m.content for m in req.messages] == [m.content for m in plain.messages]


def test_unknown_field_names_are_truncated() -> None:
    req = parse_chat_request(chat(**{LONG: 1}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "", LONG: 1}]}]))
    assert unknown_fields(req) == ["Z" * 64, "messages[0].content[0]." + "Z" * 64]


def test_unknown_fields_of_completions_are_found() -> None:
    req = parse_completion_request(completion(messages=MESSAGES, typical_p=0.9))
    assert unknown_fields(req) == ["messages", "typical_p"]


def test_a_request_may_leave_the_model_out() -> None:
    assert parse_chat_request(json.dumps({"messages": MESSAGES}).encode()).model is None

@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        ("", [""]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["hello"], ["hello"]),
        ([[4, 5]], [[4, 5]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], "b", [3]], [[1, 2], "b", [3]]),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    req = parse_completion_request(completion(prompt=prompt))
    assert req.prompt == expected


@pytest.mark.parametrize("raging", [{"timing": "yes"}, {"timing": 1}, True])
def test_a_malformed_raging_extension_is_400(raging: Any) -> None:
    err = raises_400(lambda b: generation_params(parse_chat_request(b)), chat(raging=raging))
    assert err.param is not None and err.param.startswith("raging")
