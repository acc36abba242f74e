"""Fuzzing the request validation of the real app with hypothesis.

Bodies come from four strategies: (a) our request models' JSON schema, (b) arbitrary JSON values,
(c) raw bytes, (d) valid bodies with one field, at any depth, replaced, added or removed; (b) to
(d) go to Anthropic's /v1/messages too. They are posted to the in-process gateway with a real
registry holding no workers (see served_app), so whatever passes validation ends in the
dispatcher's 503 "no worker available". The reply must never be a 500 nor a 2xx, every reply is
error JSON in the route's API's shape (OpenAI's, or Anthropic's), and a 503 must be that one.

`--fuzz-examples N` sets the examples per test; runs are derandomized for CI stability. Each test
prints how its replies were spread over status codes (`-s` shows it).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from pydantic import BaseModel
from starlette.testclient import TestClient

from gateway.embedding_request import EmbeddingRequest, LlamaEmbeddingRequest, OllamaEmbedRequest
from gateway.llamacpp_request import LlamaCompletionRequest
from gateway.messages_request import MessagesRequest
from gateway.ollama_request import OllamaChatRequest, OllamaGenerateRequest, Options
from gateway.protocol import TEXT_PART_FIELDS, ChatCompletionRequest, ChatMessage, CompletionRequest
from tests.gateway.served_app import (
    MODEL,
    ROUTES,
    error_message_of,
    is_no_worker,
    serve_without_workers,
    valid_body,
)

CHAT, TEXT = ROUTES
MESSAGES = "/v1/messages"
NATIVE = "/completion"  # llama.cpp's
OLLAMA = ("/api/chat", "/api/generate")
OLLAMA_EMBEDDINGS = {"/api/embed": "embeddings", "/api/embeddings": "embedding"}  # -> the list
Body = tuple[str, bytes]  # (route, raw body)
KeyPath = tuple[str | int, ...]  # keys and indices from the top of a JSON value

FIELD_NAMES = sorted(
    set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    | set(ChatMessage.model_fields) | TEXT_PART_FIELDS | {"include_usage"}
    | set(MessagesRequest.model_fields) | {"tool_use_id", "input", "input_schema", "name"}
    | set(LlamaCompletionRequest.model_fields) | set(OllamaChatRequest.model_fields)
    | set(OllamaGenerateRequest.model_fields) | set(Options.model_fields)
    | set(EmbeddingRequest.model_fields) | set(OllamaEmbedRequest.model_fields)
    | set(LlamaEmbeddingRequest.model_fields)
)
VALID_BODIES: dict[str, list[dict[str, Any]]] = {
    CHAT: [
        valid_body(CHAT),
        valid_body(CHAT, messages=[
            {"role": "system", "content": "be brief", "name": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c", "tool_calls": []},
            {"role": "tool", "content": "d", "tool_call_id": "t"},
        ], max_tokens=8, temperature=0.5, top_p=0.9, top_k=5, stream=True,
            stream_options={"include_usage": True}, stop=["x", "y"], stop_token_ids=[2],
            seed=3, metadata={"k": "v"}, response_format={"type": "text"}, tools=[]),
        valid_body(CHAT, messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ], tools=[{"type": "function", "function": {
            "name": "weather", "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
            tool_choice="required", parallel_tool_calls=False),
        valid_body(CHAT, functions=[{"name": "now"}], function_call={"name": "now"}),
    ],
    TEXT: [
        valid_body(TEXT),
        valid_body(TEXT, prompt=[1, 2, 3], max_tokens=4, stop="\n", ignore_eos=True, seed=-1,
                   logit_bias={}, echo=False, best_of=1, presence_penalty=1.0, user="u"),
    ],
    MESSAGES: [
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
        {"model": MODEL, "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
         "messages": [
             {"role": "user", "content": [{"type": "text", "text": "weather?",
                                           "cache_control": {"type": "ephemeral"}}]},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "t", "signature": "s"},
                 {"type": "tool_use", "id": "toolu_1", "name": "weather",
                  "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "sunny"}]}]},
             {"role": "assistant", "content": "It is"}],
         "tools": [{"name": "weather", "description": "the weather", "input_schema": {
             "type": "object", "properties": {"city": {"type": "string"}}}}],
         "tool_choice": {"type": "auto"}, "stop_sequences": ["x"], "stream": True,
         "temperature": 0.5, "top_k": 5, "metadata": {"user_id": "u"},
         "output_config": {"effort": "low"}},
    ],
    NATIVE: [
        {"prompt": "Hi", "n_predict": 8},
        {"prompt": [1, 2, 3], "n_predict": -1, "temperature": 0.5, "top_k": 40, "seed": -1,
         "stop": ["\n"], "stream": True, "n_probs": 2, "logit_bias": [[5, False], ["x", 1.5]],
         "grammar": 'root ::= "a"', "cache_prompt": True, "id_slot": -1, "mirostat": 0},
    ],
    "/api/chat": [
        {"model": f"{MODEL}:latest", "messages": [{"role": "user", "content": "Hi"}]},
        {"model": MODEL, "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "thinking": "t", "tool_calls": [
                {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "weather", "content": "sunny"}],
         "format": "json", "stream": False, "keep_alive": "5m", "logprobs": True,
         "top_logprobs": 2, "think": False,
         "options": {"num_predict": 8, "temperature": 0.5, "top_k": 5, "top_p": 0.9,
                     "seed": 3, "stop": ["x"], "repeat_penalty": 1.1, "num_ctx": 4096,
                     "mirostat": 0}},
    ],
    "/v1/embeddings": [
        {"model": MODEL, "input": "Hi"},
        {"input": [[1, 2, 3], "two"], "encoding_format": "base64", "dimensions": 8,
         "truncate_prompt_tokens": 4, "add_special_tokens": False, "normalize": False,
         "user": "u"},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "Hi"}],
         "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}},
    ],
    "/api/embed": [
        {"model": f"{MODEL}:latest", "input": ["Hi", "there"], "truncate": False,
         "dimensions": 8, "options": {"num_ctx": 512}, "keep_alive": "5m"},
    ],
    "/api/embeddings": [{"model": MODEL, "prompt": "Hi", "options": {}}],
    "/embedding": [{"content": ["Hi", [1, 2]], "embd_normalize": 1}, {"input": "Hi"}],
    "/api/generate": [
        {"model": MODEL, "prompt": "Hi", "system": "be brief", "context": [1, 2],
         "options": {"num_predict": -1}, "format": {"type": "object"}},
        {"model": MODEL, "prompt": "Once upon a time", "raw": True, "stream": False,
         "options": {"num_predict": 4, "min_p": 0.1}},
    ],
}

JSON_KEYS = st.sampled_from(FIELD_NAMES) | st.text(max_size=12)
JSON_LEAVES = (
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70)
    | st.floats() | st.text() | st.sampled_from(["text", "user", "auto", "none", MODEL])
)
# st.deferred, not st.recursive: several times faster to draw, and depth is not capped.
JSON_VALUES: st.SearchStrategy[Any] = st.deferred(
    lambda: JSON_LEAVES | st.lists(JSON_VALUES, max_size=5)
    | st.dictionaries(JSON_KEYS, JSON_VALUES, max_size=5)
)


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON text as Python writes it (NaN and Infinity included); not ASCII-only, a lone
    surrogate becomes bytes that are not UTF-8."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    return text.encode("utf-8", "surrogatepass")



# Narrowed for generation, so that many schema bodies pass validation and reach dispatch (the
# other strategies send these fields anything): features that are missing accept only their
# neutral values; ids stay in the vocabulary, completions in the context.
VOCAB_SIZE = 49152  # the real tokenizer's
NARROWED: dict[str, dict[str, Any]] = {
    **{name: {"enum": [None, value]} for name, value in {
        "n": 1, "best_of": 1, "echo": False, "suffix": "", "tool_choice": "none",
        "function_call": "none", "modalities": ["text"], "logit_bias": {}, "tools": [],
        "functions": [],
        # Above 0 it needs logprobs: true, which a schema cannot say (completions' logprobs
        # and chat's logprobs: true still ask for logprobs).
        "top_logprobs": 0,
    }.items()},
    "min_tokens": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 8}]},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                  "maximum": VOCAB_SIZE - 1}, "maxItems": 4},
    "prompt": {"anyOf": [{"type": "string"},
                         {"type": "array", "minItems": 1, "maxItems": 64,
                          "items": {"type": "integer", "minimum": 0,
                                    "maximum": VOCAB_SIZE - 1}}]},
    "messages": {"type": "array", "minItems": 1, "maxItems": 4,
                 "items": {"$ref": "#/$defs/ChatMessage"}},
}
NARROWED_IN_MESSAGES: dict[str, Any] = {
    # Null content, calls and a missing tool_call_id or name are for some roles only.
    "tool_calls": {"enum": [None, []]}, "function_call": {"type": "null"},
    "content": {"type": "string"}, "tool_call_id": {"type": "string", "maxLength": 256},
    "name": {"type": "string"},
}
REQUIRED_IN_MESSAGES = ("content", "tool_call_id", "name")


def generation_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema, narrowed as NARROWED says, its untyped fields (missing
    features: anything but null is refused) narrowed to null."""
    schema = model.model_json_schema()
    properties = schema["properties"]
    properties.update({name: NARROWED[name] for name in properties if name in NARROWED})
    message = schema.get("$defs", {}).get("ChatMessage")
    if message is not None:
        message["properties"].update(NARROWED_IN_MESSAGES)
        message["required"] = sorted({*message.get("required", []), *REQUIRED_IN_MESSAGES})
    for definition in [schema, *schema.get("$defs", {}).values()]:
        for name, prop in definition["properties"].items():
            if set(prop) <= {"default", "title"}:
                definition["properties"][name] = {"type": "null"}
    return schema


def schema_strategy(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of `model`'s generation schema."""
    schema = generation_schema(model)
    return _object_strategy(schema, schema.get("$defs", {}))


def _object_strategy(
    schema: dict[str, Any], definitions: dict[str, Any]
) -> st.SearchStrategy[dict[str, Any]]:
    """One strategy per property, each optional one present or not: several times faster than
    from_schema on the whole object, which draws its properties one by one."""
    fields = {name: _property_strategy(prop, definitions)
              for name, prop in schema["properties"].items()}
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {name: field for name, field in fields.items() if name in required},
        optional={name: field for name, field in fields.items() if name not in required},
    )


def _property_strategy(prop: dict[str, Any], definitions: dict[str, Any]) -> st.SearchStrategy[Any]:
    items = prop.get("items", {})
    if prop.get("type") == "array" and "$ref" in items:  # the messages
        element = _object_strategy(definitions[items["$ref"].split("/")[-1]], definitions)
        return st.lists(element, min_size=prop.get("minItems", 0), max_size=prop["maxItems"])
    return from_schema({**prop, "$defs": _referenced(prop, definitions)})


def _referenced(schema: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    """The definitions `schema` refers to, directly or through others: hypothesis_jsonschema
    checks every schema it derives against its metaschema, $defs and all, and caches only 128,
    so unused ones made the strategies several times slower to build and draw."""
    found: dict[str, Any] = {}
    pending = [schema]
    while pending:
        text = json.dumps(pending.pop())
        for name, definition in definitions.items():
            if name not in found and f'"#/$defs/{name}"' in text:
                found[name] = definition
                pending.append(definition)
    return found


SCHEMA_STRATEGIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    CHAT: schema_strategy(ChatCompletionRequest),
    TEXT: schema_strategy(CompletionRequest),
}


@st.composite
def schema_bodies(draw: st.DrawFn) -> Body:
    """(a) Bodies our models' JSON schema allows; mostly naming the served model, so that
    they get past the model check (validators stricter than the schema still refuse some)."""
    route = draw(st.sampled_from(ROUTES))
    body = draw(SCHEMA_STRATEGIES[route])
    if draw(st.sampled_from([True, True, True, False])):
        body["model"] = MODEL
    return route, encode(body, draw(st.booleans()))


@st.composite
def json_bodies(draw: st.DrawFn) -> Body:
    """(b) Any JSON value, objects keyed mostly by our field names."""
    value = draw(JSON_VALUES | st.dictionaries(JSON_KEYS, JSON_VALUES, max_size=8))
    return draw(st.sampled_from(list(VALID_BODIES))), encode(value, draw(st.booleans()))


@st.composite
def byte_bodies(draw: st.DrawFn) -> Body:
    """(c) Raw bytes: random ones, or a valid body with bytes inserted, replaced or cut."""
    route = draw(st.sampled_from(list(VALID_BODIES)))
    if draw(st.booleans()):
        return route, draw(st.binary(max_size=512))
    raw = json.dumps(draw(st.sampled_from(VALID_BODIES[route]))).encode()
    start = draw(st.integers(0, len(raw)))
    end = draw(st.integers(start, min(len(raw), start + 8)))
    return route, raw[:start] + draw(st.binary(max_size=8)) + raw[end:]


def _paths(value: Any, prefix: KeyPath = ()) -> Iterator[KeyPath]:
    """Every key path into a JSON value, the value's own (the empty path) excluded."""
    items: Any = (value.items() if isinstance(value, dict)
                  else enumerate(value) if isinstance(value, list) else ())
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _replace(value: Any, path: KeyPath, edit: Callable[[Any, str | int], None]) -> Any:
    """A deep copy of `value` with `edit(container, last key)` applied at `path`."""
    copy = json.loads(json.dumps(value))
    container = copy
    for key in path[:-1]:
        container = container[key]
    edit(container, path[-1])
    return copy


@st.composite
def mutated_bodies(draw: st.DrawFn) -> Body:
    """(d) A valid body with one field, at any depth, set to any JSON value or removed, or a new
    field (likely one of ours, at the wrong level) added to one of its objects."""
    route = draw(st.sampled_from(list(VALID_BODIES)))
    body = draw(st.sampled_from(VALID_BODIES[route]))
    paths = list(_paths(body))
    action = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
    if action == "delete":
        mutated = _replace(body, draw(st.sampled_from(paths)), _delete)
    else:
        if action == "add":
            objects = [(), *(p for p in paths if isinstance(_at(body, p), dict))]
            path = (*draw(st.sampled_from(objects)), draw(JSON_KEYS))
        else:
            path = draw(st.sampled_from(paths))
        new = draw(JSON_VALUES)
        mutated = _replace(body, path, lambda container, key: _set(container, key, new))
    return route, encode(mutated, draw(st.booleans()))


def _at(value: Any, path: KeyPath) -> Any:
    for key in path:
        value = value[key]
    return value


def _delete(container: Any, key: str | int) -> None:
    del container[key]


def _set(container: Any, key: str | int, new: Any) -> None:
    container[key] = new



@pytest.fixture(scope="module")
def client(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir) as client:
        yield client


def check_reply(client: TestClient, route: str, body: bytes) -> int:
    """Post one body: any reply but a 4xx error in the route's shape or the no-worker 503 is a
    failure (but Ollama's answer to a body with nothing to generate or embed: the model
    'loads').
    Returns the status code."""
    response = client.post(route, content=body, headers={"content-type": "application/json"})
    assert response.status_code != 500, response.text
    if route in OLLAMA and response.status_code == 200:
        assert response.json()["done_reason"] in ("load", "unload"), response.text
        return 200
    if route in OLLAMA_EMBEDDINGS and response.status_code == 200:  # no input: 'loads'
        assert response.json()[OLLAMA_EMBEDDINGS[route]] == [], response.text
        return 200
    assert 400 <= response.status_code < 500 or is_no_worker(response, route), response.text
    error_message_of(response, route)
    return response.status_code


def fuzz(client: TestClient, bodies: st.SearchStrategy[Body], examples: int) -> Counter[int]:
    """Run `check_reply` on `examples` bodies drawn from `bodies`, reproducibly; how many
    replies had each status code (printed: see them with -s)."""
    statuses: Counter[int] = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies)
    def run(body: Body) -> None:
        statuses[check_reply(client, *body)] += 1

    run()
    print(f"{sum(statuses.values())} bodies, replies by status: {dict(sorted(statuses.items()))}")
    return statuses


def test_valid_bodies_reach_dispatch(client: TestClient) -> None:
    for route, bodies in VALID_BODIES.items():
        for body in bodies:
            assert is_no_worker(client.post(route, json=body), route)


def test_fuzz_schema_bodies(client: TestClient, fuzz_examples: int) -> None:
    statuses = fuzz(client, schema_bodies(), fuzz_examples)
    # Most must get through validation, or this fuzzes little beyond the first check.
    assert statuses[503] >= sum(statuses.values()) // 3


def test_fuzz_json_values(client: TestClient, fuzz_examples: int) -> None:
    fuzz(client, json_bodies(), fuzz_examples)


def test_fuzz_raw_bytes(client: TestClient, fuzz_examples: int) -> None:
    fuzz(client, byte_bodies(), fuzz_examples)


def test_fuzz_one_field_mutated(client: TestClient, fuzz_examples: int) -> None:
    fuzz(client, mutated_bodies(), fuzz_examples)
