"""Malformed requests: each one a 400 naming the field, never quoting a long value (parse_body,
gateway/validation.py); against the real app, a 4xx OpenAI error, and the app keeps serving.

Every case is posted to the in-process gateway (real registry with no workers, see served_app);
the reply must be a 4xx with the OpenAI error JSON, a capped message that never quotes the long
marker string the body carries, and a valid request right after must still reach dispatch.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel
from starlette.testclient import TestClient

from gateway.chat_request import parse_chat_request
from gateway.protocol import (
    TEXT_PART_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    parse_completion_request,
)
from gateway.validation import replace_lone_surrogates
from tests.gateway.served_app import (
    MODEL,
    NO_WORKER,
    ROUTES,
    assert_still_serving,
    error_of,
    serve_without_workers,
    valid_body,
)
from tests.gateway.test_protocol import LONG, MESSAGES, chat, completion, raises_400

CHAT, TEXT = ROUTES
MARKER = "MARKER-" + "q" * 5000 + "-END"
REQUEST_MODELS: dict[str, type[BaseModel]] = {CHAT: ChatCompletionRequest, TEXT: CompletionRequest}


@pytest.fixture(scope="module")
def client(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir) as client:
        yield client


@dataclass(frozen=True)
class Case:
    """One malformed request: its raw body and what the error must say."""

    name: str
    body: bytes
    param: str | None = None  # the error's `param`, when the case pins it
    says: str = ""  # a phrase the message must contain
    status: int = 400


def _json(route: str, **fields: Any) -> bytes:
    return json.dumps(valid_body(route, **{"user": MARKER, **fields})).encode()


def _with_raw(route: str, field: str, raw: bytes) -> bytes:
    """A valid body plus `"field": raw`, for what json.dumps cannot write."""
    return _json(route)[:-1] + b', "' + field.encode() + b'": ' + raw + b"}"


def _nested(depth: int, opening: bytes, closing: bytes) -> bytes:
    return opening * depth + closing * depth


def common_cases(route: str) -> list[Case]:
    """What either route must refuse."""
    body = _json(route)
    deep_lists = _nested(100_000, b"[", b"]")
    deep_objects = _nested(100_000, b'{"a":', b"}")
    cases = [
        Case("empty body", b""),
        Case("null", b"null"),
        Case("string", b'"x"'),
        Case("array", b"[]"),
        Case("empty object", b"{}"),
        Case("number", b"42"),
        Case("truncated", body[: len(body) // 2]),
        Case("truncated by one", body[:-1]),
        Case("bad utf-8 body", b"\xff\xfe" + body),
        Case("bad utf-8 in a string", _json(route, user="x").replace(b'"x"', b'"\xc3\x28"')),
        Case("trailing garbage", body + b"}"),
        Case("two documents", body + body),
        Case("unknown model", _json(route, model=MARKER[:256]), "model", status=404),
        Case("n=0", _json(route, n=0), "n"),
        Case("n=17", _json(route, n=17), "n", says="n must be at most 16"),
        Case("n huge", _json(route, n=10**30), "n", says="at most 16"),
        Case("max_tokens -1", _json(route, max_tokens=-1), "max_tokens"),
        Case("max_tokens 0", _json(route, max_tokens=0), "max_tokens" if route == CHAT else None,
             says="greater than" if route == CHAT else "needs echo"),
        Case("max_tokens 10**12", _json(route, max_tokens=10**12), "max_tokens",
             says="maximum context length"),
        Case("max_tokens 2**63", _json(route, max_tokens=2**63 - 1), "max_tokens",
             says="maximum context length"),
        Case("max_tokens 2**64", _json(route, max_tokens=2**64), "max_tokens"),
        Case("max_tokens 4000 digits", _with_raw(route, "max_tokens", b"9" * 4000), "max_tokens"),
        Case("max_tokens 4300 digits", _with_raw(route, "max_tokens", b"9" * 4300), "max_tokens"),
        Case("max_tokens 4305 digits", _with_raw(route, "max_tokens", b"9" * 4305)),
        Case("max_tokens 10**5000", _with_raw(route, "max_tokens", b"1" + b"0" * 5000)),
        Case("max_tokens float", _json(route, max_tokens=16.0), "max_tokens"),
        Case("temperature NaN", _with_raw(route, "temperature", b"NaN"), "temperature"),
        Case("temperature Infinity", _with_raw(route, "temperature", b"Infinity"), "temperature"),
        Case("temperature -Infinity", _with_raw(route, "temperature", b"-Infinity"),
             "temperature"),
        Case("temperature 1e400", _with_raw(route, "temperature", b"1e400"), "temperature"),
        Case("temperature -1", _json(route, temperature=-1), "temperature"),
        Case("top_p 0", _json(route, top_p=0), "top_p"),
        Case("top_p -1", _json(route, top_p=-1), "top_p"),
        Case("top_p 1.5", _json(route, top_p=1.5), "top_p"),
        Case("top_p NaN", _with_raw(route, "top_p", b"NaN"), "top_p"),
        Case("top_k huge", _json(route, top_k=2**64), "top_k"),
        Case("seed huge", _json(route, seed=2**64), "seed"),
        Case("10k stop strings", _json(route, stop=[f"s{i}" for i in range(10_000)]), "stop",
             says="at most"),
        Case("1 MB stop string", _json(route, stop=MARKER + "s" * 1_000_000), "stop"),
        Case("1 MB stop string in a list", _json(route, stop=["a", MARKER * 200]), "stop"),
        Case("stop number", _json(route, stop=7), "stop"),
        Case("stop nested", _json(route, stop=[[MARKER]]), "stop"),
        Case("stop_token_ids beyond the vocabulary", _json(route, stop_token_ids=[10**9]),
             "stop_token_ids"),
        Case("deep lists as a value", _with_raw(route, "user", deep_lists)),
        Case("deep lists as the body", deep_lists),
        Case("deep objects as the body", deep_objects),
        Case("deep unclosed lists", b"[" * 100_000),
        Case("duplicate key", _with_raw(route, "model", b'"' + MODEL.encode() + b'"'), "model",
             says="Duplicate key"),
        Case("duplicate key, long value", _with_raw(route, "user", json.dumps(MARKER).encode()),
             "user", says="Duplicate key"),
        Case("logit_bias past the vocabulary", _json(route, logit_bias={"100000": 5}),
             "logit_bias", says="below"),
        Case("logit_bias not a token id", _json(route, logit_bias={"hello": 5}), "logit_bias",
             says="token ids"),
        Case("logit_bias past 100", _json(route, logit_bias={"50": 101}), "logit_bias.50"),
    ]
    return cases


def chat_cases() -> list[Case]:
    """What /v1/chat/completions must refuse beyond the common cases."""
    def with_messages(messages: Any) -> bytes:
        return _json(CHAT, messages=messages)

    def content(value: Any) -> bytes:
        return with_messages([{"role": "user", "content": value}])

    return [
        Case("missing messages", json.dumps({"model": MODEL, "user": MARKER}).encode(),
             "messages"),
        Case("empty messages", with_messages([]), "messages"),
        Case("messages object", with_messages({"role": "user", "content": MARKER}), "messages"),
        Case("message not an object", with_messages([MARKER]), "messages[0]"),
        Case("message without role", with_messages([{"content": MARKER}]), "messages[0].role"),
        Case("unknown role", with_messages([{"role": MARKER, "content": "x"}]),
             "messages[0].role"),
        Case("content number", content(42), "messages[0].content"),
        Case("content float", content(4.2), "messages[0].content"),
        Case("content bool", content(True), "messages[0].content"),
        Case("content null", content(None), "messages[0].content"),
        Case("content object", content({"text": MARKER}), "messages[0].content"),
        Case("content nested object", content({"a": {"b": [MARKER]}}), "messages[0].content"),
        Case("content list of strings", content([MARKER]), "messages[0].content"),
        Case("content list of numbers", content([1, 2]), "messages[0].content"),
        Case("content list of lists", content([[{"type": "text", "text": MARKER}]]),
             "messages[0].content"),
        Case("content image part", content([{"type": "image_url", "image_url": {"url": MARKER}}]),
             "messages[0].content[0]", says="image input is not supported"),
        Case("content audio part", content([{"type": "text", "text": "x"}, {
            "type": "input_audio", "input_audio": {"data": MARKER, "format": "wav"}}]),
             "messages[0].content[1]", says="audio input is not supported"),
        Case("content file part", content([{"type": "file", "file": {"file_data": MARKER}}]),
             "messages[0].content[0]", says="file input is not supported"),
        Case("continue a user message", _json(CHAT, continue_final_message=True,
                                              add_generation_prompt=False), None,
             says="assistant"),
        Case("allowed_token_ids beyond the vocabulary", _json(CHAT, allowed_token_ids=[10**9]),
             "allowed_token_ids"),
        Case("content part text number", content([{"type": "text", "text": 5}]),
             "messages[0].content"),
        Case("tool calls", with_messages([{"role": "assistant", "content": "",
                                           "tool_calls": [{"id": MARKER}]}]),
             "messages[0].tool_calls[0].id", says="at most 256"),
        Case("tools", _json(CHAT, tools=[{"type": "function", "function": {"name": MARKER}}]),
             "tools[0].function.name", says="pattern"),
        Case("tool_choice required", _json(CHAT, tool_choice="required"), "tool_choice",
             says="no tools"),
        Case("top_logprobs without logprobs", _json(CHAT, top_logprobs=2), "top_logprobs",
             says="logprobs"),
        Case("response_format xml", _json(CHAT, response_format={"type": "xml"}),
             "response_format.type"),
        Case("response_format bad schema", _json(CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": MARKER}}}),
             "response_format", says="invalid JSON schema"),
        Case("audio", _json(CHAT, audio={"voice": MARKER, "format": "wav"}), "audio",
             says="not supported"),
        Case("modalities audio", _json(CHAT, modalities=["text", "audio"]), "modalities",
             says="not supported"),
        Case("stream_options without stream", _json(CHAT, stream_options={"include_usage": True}),
             "stream_options"),
        Case("max_completion_tokens 10**12", _json(CHAT, max_completion_tokens=10**12),
             "max_tokens", says="maximum context length"),
        Case("max_completion_tokens 2**64", _json(CHAT, max_completion_tokens=2**64),
             "max_completion_tokens"),
    ]


def completion_cases() -> list[Case]:
    """What /v1/completions must refuse beyond the common cases."""
    return [
        Case("missing prompt", json.dumps({"model": MODEL, "user": MARKER}).encode(), "prompt"),
        Case("prompt null", _json(TEXT, prompt=None), "prompt"),
        Case("prompt number", _json(TEXT, prompt=42), "prompt"),
        Case("prompt object", _json(TEXT, prompt={"text": MARKER}), "prompt"),
        Case("prompt empty list", _json(TEXT, prompt=[]), "prompt"),
        Case("prompt list of objects", _json(TEXT, prompt=[{"a": MARKER}]), "prompt"),
        Case("prompt a string and an empty list", _json(TEXT, prompt=[MARKER, []]), "prompt"),
        Case("prompts times n over 16", _json(TEXT, prompt=[MARKER] * 6, n=3), None),
        Case("prompt floats", _json(TEXT, prompt=[1.5]), "prompt"),
        Case("prompt bools", _json(TEXT, prompt=[True]), "prompt"),
        Case("prompt negative id", _json(TEXT, prompt=[-1]), "prompt"),
        Case("prompt id beyond the vocabulary", _json(TEXT, prompt=[2**64]), "prompt"),
        Case("prompt too long", _json(TEXT, prompt=list(range(3000))), None,
             says="maximum context length"),
        Case("echo with logprobs past 5", _json(TEXT, echo=True, logprobs=6), "logprobs"),
        Case("suffix", _json(TEXT, suffix=MARKER), "suffix", says="fill-in-the-middle"),
        Case("best_of", _json(TEXT, best_of=3), "best_of"),
    ]


# One value of each JSON type; a field gets those its schema does not allow.
WRONG_VALUES: dict[str, Any] = {
    "null": None, "boolean": True, "integer": 7, "number": 2.5, "string": MARKER,
    "array": [MARKER], "object": {"k": MARKER},
}
# Types a field accepts beyond its schema (a `mode="before"` validator normalizes them).
ALSO_ACCEPTED: dict[str, set[str]] = {"stop": {"string"}, "prompt": {"string"}}


def _json_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a property's schema allows; empty for a schema that allows anything."""
    if "$ref" in schema:
        return {"object"}
    if "anyOf" in schema:
        return set().union(*(_json_types(branch) for branch in schema["anyOf"]))
    if "type" not in schema:
        return set()
    types = {schema["type"]}
    return types | {"integer"} if "number" in types else types


def wrong_type_cases(route: str) -> list[Case]:
    """For every top-level field, a value of each JSON type it does not accept."""
    properties = REQUEST_MODELS[route].model_json_schema()["properties"]
    cases = []
    for field, schema in properties.items():
        allowed = _json_types(schema) | ALSO_ACCEPTED.get(field, set())
        if not allowed:
            continue  # typed Any: the unsupported-feature cases cover it
        for kind, value in WRONG_VALUES.items():
            if kind not in allowed:
                body = json.dumps({**valid_body(route, user="u"), field: value}).encode()
                cases.append(Case(f"{field} as {kind}", body, field))
    return cases


CASES = [(route, case) for route in ROUTES for case in common_cases(route)]
CASES += [(CHAT, case) for case in chat_cases()]
CASES += [(TEXT, case) for case in completion_cases()]
CASES += [(route, case) for route in ROUTES for case in wrong_type_cases(route)]


@pytest.mark.parametrize(("route", "case"), CASES, ids=[f"{r[4:]}-{c.name}" for r, c in CASES])
def test_malformed_request_is_a_4xx(client: TestClient, route: str, case: Case) -> None:
    response = client.post(route, content=case.body,
                           headers={"content-type": "application/json"})
    assert response.status_code == case.status, response.text
    error = error_of(response)
    assert MARKER not in response.text
    assert len(response.content) < 2000
    if case.param is not None:
        assert error["param"] == case.param, error
    assert case.says in error["message"]
    assert_still_serving(client, route)


def test_every_field_has_wrong_type_cases() -> None:
    for route, model in REQUEST_MODELS.items():
        covered = {case.param for case in wrong_type_cases(route)}
        typed = {name for name, field in model.model_fields.items()
                 if field.annotation is not Any}
        assert typed <= covered, typed - covered


@pytest.mark.parametrize("route", ROUTES)
def test_valid_request_reaches_dispatch(client: TestClient, route: str) -> None:
    response = client.post(route, json=valid_body(route, user=MARKER))
    assert response.status_code == 503
    assert error_of(response)["message"] == NO_WORKER
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model", [None, "", "left out"])
def test_a_request_naming_no_model_gets_the_served_one(client: TestClient, route: str,
                                                       model: str | None) -> None:
    """As vLLM and llama.cpp: `model` null, empty or left out is the served model, not a 400
    (a client with no model picked sends "")."""
    body = valid_body(route, user=MARKER)
    if model == "left out":
        del body["model"]
    else:
        body["model"] = model
    response = client.post(route, json=body)
    assert response.status_code == 503
    assert error_of(response)["message"] == NO_WORKER


def _fields(typed_dicts: tuple[type, ...]) -> set[str]:
    return set().union(*(typing.get_type_hints(td).keys() for td in typed_dicts))


OPENAI_FIELDS: dict[str, set[str]] = {
    CHAT: _fields((chat_params.CompletionCreateParamsNonStreaming,
                   chat_params.CompletionCreateParamsStreaming)),
    TEXT: _fields((text_params.CompletionCreateParamsNonStreaming,
                   text_params.CompletionCreateParamsStreaming)),
}
OPENAI_MESSAGE_FIELDS = _fields(tuple(
    getattr(openai.types.chat, f"ChatCompletion{role}MessageParam")
    for role in ("System", "User", "Assistant", "Tool", "Developer", "Function")
))


@pytest.mark.parametrize("route", ROUTES)
def test_every_openai_client_field_is_known(route: str) -> None:
    """A newer openai client with a new field fails here rather than getting 400s in use."""
    assert OPENAI_FIELDS[route] - set(REQUEST_MODELS[route].model_fields) == set()


def test_every_openai_nested_field_is_known() -> None:
    assert OPENAI_MESSAGE_FIELDS - set(ChatMessage.model_fields) == set()
    stream_options = _fields((openai.types.chat.ChatCompletionStreamOptionsParam,))
    assert stream_options - set(StreamOptions.model_fields) == set()
    text_part = _fields((openai.types.chat.ChatCompletionContentPartTextParam,))
    assert text_part - TEXT_PART_FIELDS == set()


# Every field the openai client can send, with a value that asks for nothing unsupported.
CHAT_FIELDS: dict[str, Any] = {
    "model": MODEL, "audio": None, "frequency_penalty": 0.5, "function_call": "none",
    "functions": [], "logit_bias": {}, "logprobs": False, "max_completion_tokens": 8,
    "max_tokens": 8, "metadata": {"k": "v"}, "modalities": ["text"], "moderation": None, "n": 1,
    "parallel_tool_calls": False, "prediction": None, "presence_penalty": -0.5,
    "prompt_cache_key": "k", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "in_memory", "reasoning_effort": "low",
    "response_format": {"type": "text"}, "safety_identifier": "s", "seed": 1,
    "service_tier": "auto", "stop": ["END"], "store": False, "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False}, "temperature": 0.7,
    "tool_choice": "none", "tools": [], "top_logprobs": 0, "top_p": 0.9, "user": "u",
    "verbosity": "low", "web_search_options": None,
    "messages": [
        {"role": "system", "content": "be brief", "name": "s"},
        {"role": "developer", "content": [{"type": "text", "text": "really"}], "name": "d"},
        {"role": "user", "name": "u", "content": [
            {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}]},
        {"role": "assistant", "content": "hello", "name": "a", "refusal": None,
         "tool_calls": [], "function_call": None, "audio": None},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"},
        {"role": "user", "content": "and?"},
    ],
}
TEXT_FIELDS: dict[str, Any] = {
    "model": MODEL, "prompt": "Once", "best_of": 1, "echo": False, "frequency_penalty": 0.5,
    "logit_bias": {}, "logprobs": None, "max_tokens": 8, "n": 1, "presence_penalty": 0.0,
    "seed": 2, "stop": "END", "stream": True, "stream_options": {"include_usage": False},
    "suffix": None, "temperature": 0.0, "top_p": 1.0, "user": "u",
}
# Our documented extensions, passed by the openai client as `extra_body`.
EXTENSIONS: dict[str, Any] = {
    "top_k": 5, "ignore_eos": True, "stop_token_ids": [2], "min_tokens": 0,
    "repetition_penalty": 1.0, "repeat_penalty": 1.0, "min_p": 0.05,
    "skip_special_tokens": False, "include_stop_str_in_output": True,
    "allowed_token_ids": [1, 2, 3], "bad_words": ["never"], "priority": 1,
}
CHAT_EXTENSIONS: dict[str, Any] = {
    **EXTENSIONS, "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": True, "continue_final_message": False,
}


@pytest.fixture
def openai_client(client: TestClient) -> openai.OpenAI:
    # TestClient is an httpx.Client: the official client talks to the in-process app.
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=client)


@pytest.mark.parametrize(("route", "fields"), [(CHAT, CHAT_FIELDS), (TEXT, TEXT_FIELDS)])
def test_sample_covers_every_openai_field(route: str, fields: dict[str, Any]) -> None:
    assert OPENAI_FIELDS[route] - set(fields) == set()


@pytest.mark.parametrize("stream", [True, False])
def test_openai_client_chat_with_every_field_reaches_dispatch(
    openai_client: openai.OpenAI, stream: bool
) -> None:
    fields = {**CHAT_FIELDS, "stream": stream}
    if not stream:
        del fields["stream_options"]
    with pytest.raises(openai.InternalServerError) as info:
        openai_client.chat.completions.create(**fields, extra_body=CHAT_EXTENSIONS)
    assert info.value.status_code == 503
    assert info.value.body == {"message": NO_WORKER, "type": "service_unavailable",
                               "param": None, "code": None}


@pytest.mark.parametrize("stream", [True, False])
def test_openai_client_completion_with_every_field_reaches_dispatch(
    openai_client: openai.OpenAI, stream: bool
) -> None:
    fields = {**TEXT_FIELDS, "stream": stream}
    if not stream:
        del fields["stream_options"]
    with pytest.raises(openai.InternalServerError) as info:
        openai_client.completions.create(**fields, extra_body=EXTENSIONS)
    assert info.value.status_code == 503
    assert info.value.body == {"message": NO_WORKER, "type": "service_unavailable",
                               "param": None, "code": None}


def test_openai_client_retrieves_the_model_and_no_other(openai_client: openai.OpenAI) -> None:
    card = openai_client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "raging")
    assert card.model_dump() == openai_client.models.list().data[0].model_dump()
    for other in ("gpt-4o", "org/some-model"):
        with pytest.raises(openai.NotFoundError) as info:
            openai_client.models.retrieve(other)
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found"


def test_anthropic_client_lists_and_retrieves_the_model(client: TestClient) -> None:
    made = anthropic.Anthropic(base_url="http://testserver", api_key="unused", max_retries=0,
                               http_client=client)
    [listed] = made.models.list().data
    card = made.models.retrieve(MODEL)
    assert (card.id, card.type, card.display_name) == (MODEL, "model", MODEL)
    assert card.created_at.tzinfo is not None and card == listed
    with pytest.raises(anthropic.NotFoundError):
        made.models.retrieve("claude-sonnet-4-5")


UNKNOWN_FIELDS: dict[str, dict[str, Any]] = {  # route: extra_body, with where the first sits
    CHAT: {"tempreture": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        "stream_options": {"include_usage": True, "cached_usage_stats": True}},
    TEXT: {"tempreture": 1, "typical_p": 0.9, "stream_options": {"cached_usage_stats": 1}},
}


def _create(client: openai.OpenAI, route: str, extra_body: dict[str, Any]) -> None:
    if route == CHAT:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       stream=True, extra_body=extra_body)
    else:
        client.completions.create(model=MODEL, prompt="x", stream=True, extra_body=extra_body)


@pytest.mark.parametrize("route", ROUTES)
def test_openai_client_unknown_fields_are_ignored_and_counted(
    openai_client: openai.OpenAI, client: TestClient, route: str,
) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        _create(openai_client, route, UNKNOWN_FIELDS[route])
    assert info.value.status_code == 503  # it passed every check
    metrics = client.get("/metrics").text
    assert 'raging_ignored_fields_total{field="tempreture"}' in metrics
    assert 'raging_ignored_fields_total{field="stream_options.cached_usage_stats"}' in metrics
    if route == CHAT:
        assert 'field="messages.content.cache_control"' in metrics


@pytest.mark.parametrize("route", ROUTES)
def test_strict_fields_gets_the_unknown_field_named(real_model_dir: Path, route: str) -> None:
    with serve_without_workers(real_model_dir, **{"gateway.strict_fields": True}) as strict:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                               max_retries=0, http_client=strict)
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, route, UNKNOWN_FIELDS[route])
        assert info.value.body == {"message": "Unrecognized request argument supplied: "
                                              "tempreture",
                                   "type": "invalid_request_error", "param": "tempreture",
                                   "code": None}
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, route, {"stream_options": {"cached_usage_stats": True}})
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "stream_options.cached_usage_stats"
        with pytest.raises(openai.InternalServerError):  # known fields only: on to dispatch
            _create(client, route, {"min_p": 0.1})


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "m", "model": "m", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "m", "messages": [{"role": "user", "role": "user", "content": "hi"}]}', "role"),
])
def test_a_repeated_key_in_a_chat_body_is_400(body: bytes, param: str) -> None:
    err = raises_400(parse_chat_request, body)
    assert err.param == param
    assert param in err.message


def test_duplicate_keys_are_named() -> None:
    err = raises_400(parse_completion_request, completion().replace(b'{', b'{"seed": 1, ', 1)[:-1]
                     + b', "seed": 2}')
    assert (err.message, err.param) == ("Duplicate key 'seed' in the request body", "seed")


@pytest.mark.parametrize(
    "body",
    [
        chat(model=LONG + "x" * 300),
        chat(temperature=LONG),
        chat(stop=[LONG]),
        chat(messages=[{"role": LONG, "content": "hi"}]),
        chat(messages=[{"role": "user", "content": [{"type": LONG}]}]),
        json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": LONG}).encode(),
        b'{"model": "' + LONG.encode(),
    ],
)
def test_errors_never_echo_large_input(body: bytes) -> None:
    err = raises_400(parse_chat_request, body)
    text = json.dumps(err.to_body())
    assert "ZZZZZZZZ" not in text
    assert len(text) < 1500


@pytest.mark.parametrize(
    "body",
    [
        chat(metadata={LONG: 1}),
        chat().replace(b'{', b'{"' + LONG.encode() + b'": 1, "' + LONG.encode() + b'": 2, ', 1),
    ],
)
def test_field_names_are_quoted_truncated(body: bytes) -> None:
    err = raises_400(parse_chat_request, body)
    text = json.dumps(err.to_body())
    assert "Z" * 64 in text
    assert "Z" * 65 not in text


def test_request_models_are_frozen() -> None:
    req = parse_chat_request(chat())
    assert isinstance(req, ChatCompletionRequest)
    with pytest.raises(ValueError):
        req.model = "other"


@pytest.mark.parametrize(("escaped", "text"), [
    (rb"\ud800 hi", "\ufffd hi"),  # a high half alone
    (rb"\udc00x\ud83d", "\ufffdx\ufffd"),  # a low half alone, a high one at the end
    (rb"\ud83d\ude00 ok\n", "\U0001f600 ok\n"),  # a pair is the character
    (rb"\uD83D\uDE00", "\U0001f600"),
    (rb"\\ud800", "\\ud800"),  # an escaped backslash, then text
    (rb"\\\ud800", "\\\ufffd"),  # an escaped backslash, then a lone half
])
def test_a_lone_surrogate_reads_as_a_broken_character(escaped: bytes, text: str) -> None:
    """As a browser's script that cut a string inside an emoji sends it; Python's own JSON
    reader takes it too, and a tokenizer could not."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + escaped + b'"}]}'
    assert json.loads(replace_lone_surrogates(body))["messages"][0]["content"] == text
    assert parse_chat_request(body).messages[0].content == text
