"""Tool calling end to end on the real SmolLM2-135M-Instruct (its template ignores tools: the
fallback prompt shows them), through the official openai client as its docs call it, through
langchain-openai, and with the bodies a chat UI sends. 1 gateway + 1 prefill + 1 decode real
processes; a second cluster runs the hermes parser for tool_choice auto."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from pydantic import SecretStr

from tests.e2e.cluster import REAL_LAUNCH_S, Cluster, launch, sse_events

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

MAX_TOKENS = 200
# The function of the openai client's tool-calling example (README / the API reference).
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country e.g. Bogotá, Colombia"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location"],
    "additionalProperties": False,
}
WEATHER: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "get_weather", "description": "Get current temperature for a given location.",
    "parameters": WEATHER_PARAMETERS}}
TIME: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME["function"]["parameters"]}
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather like in Paris today?"}]


def check_calls(calls: list[Any], offered: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each call well formed, of an offered function, its arguments valid: (name, arguments)."""
    checked = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in offered
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        checked.append((call.function.name, arguments))
    return checked


def test_the_openai_docs_round_trip_with_a_required_call(
        client: openai.OpenAI, cluster: Cluster) -> None:
    messages = list(QUESTION)
    completion = client.chat.completions.create(
        model=cluster.model, messages=messages, tools=[WEATHER], tool_choice="required",
        max_tokens=MAX_TOKENS, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather"})
    # As the docs go on: the assistant's message, each call's result, and ask again.
    messages.append(choice.message)  # type: ignore[arg-type]  # as the docs do
    for call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": "14 degrees celsius, light rain"})
    again = client.chat.completions.create(model=cluster.model, messages=messages,
                                           tools=[WEATHER], max_tokens=48, temperature=0)
    answer = again.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert answer.message.tool_calls is None  # auto with no parser configured: text


def test_a_named_call_streams_its_arguments(client: openai.OpenAI, cluster: Cluster) -> None:
    stream = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, tools=[TIME, WEATHER], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS, temperature=0.7, seed=5)
    firsts, arguments, reasons = [], "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            assert call.index == 0
            if call.id is not None:
                firsts.append((call.id, call.type, call.function and call.function.name))
            arguments += (call.function and call.function.arguments) or ""
        reasons.append(chunk.choices[0].finish_reason)
    [(call_id, kind, name)] = firsts
    assert call_id.startswith("call_") and kind == "function" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert [r for r in reasons if r] == ["tool_calls"]


def test_required_calls_stream_and_validate(client: openai.OpenAI, cluster: Cluster) -> None:
    for seed in (1, 2):
        stream = client.chat.completions.create(
            model=cluster.model, messages=[{"role": "user", "content": "Time in Tokyo?"}],
            tools=[WEATHER, TIME], tool_choice="required", stream=True,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        calls: dict[int, dict[str, str]] = {}
        for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                assert call.function is not None
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        assert calls and sorted(calls) == list(range(len(calls)))
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_without_parallel_calls_there_is_one(client: openai.OpenAI, cluster: Cluster) -> None:
    completion = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=9)
    calls = completion.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    check_calls(calls, {"get_weather", "get_time"})


def test_auto_without_a_parser_answers_in_text(client: openai.OpenAI, cluster: Cluster) -> None:
    for choice_asked in ("auto", "none"):
        completion = client.chat.completions.create(
            model=cluster.model, messages=QUESTION, tools=[WEATHER], tool_choice=choice_asked,
            max_tokens=32, temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str) and choice.message.tool_calls is None


def test_langchain_bind_tools_returns_tool_calls(cluster: Cluster) -> None:
    model = ChatOpenAI(model=cluster.model, base_url=f"{cluster.url}/v1",
                       api_key=SecretStr("unused"), max_completion_tokens=MAX_TOKENS,
                       temperature=0, max_retries=0, timeout=300)
    for tool_choice in ("get_weather", "any"):  # langchain's words: named, and required
        reply = model.bind_tools([dict(WEATHER)], tool_choice=tool_choice).invoke(
            "What is the weather like in Paris today?")
        assert isinstance(reply, AIMessage) and reply.tool_calls
        assert len(reply.tool_calls) == 1 or tool_choice == "any"  # named: one call
        for call in reply.tool_calls:
            assert call["name"] == "get_weather"
            assert call["id"] is not None and call["id"].startswith("call_")
            jsonschema.validate(call["args"], WEATHER_PARAMETERS)


def test_legacy_function_call_is_answered_as_one(cluster: Cluster) -> None:
    body = {"model": cluster.model, "messages": QUESTION, "max_tokens": MAX_TOKENS,
            "temperature": 0, "functions": [WEATHER["function"]],
            "function_call": {"name": "get_weather"}}
    reply = cluster.client.post("/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "function_call"
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)


# What Open WebUI (0.6, native function calling) sends on a chat turn: its built-in tools
# offered, streaming. max_tokens is set: a default cap for requests without one is not ours.
OPEN_WEBUI_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web for up-to-date information.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "The search query"}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "get_current_timestamp", "description": "Get the current Unix timestamp.",
        "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "query_knowledge_bases",
        "description": "Search the user's knowledge bases for relevant documents.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "count": {"type": "integer", "default": 5}},
            "required": ["query"]}}},
]
OPEN_WEBUI_TURN: dict[str, Any] = {
    "stream": True, "max_tokens": 64,
    "messages": [{"role": "user", "content": "What year did the Eiffel Tower open?"}],
    "tools": OPEN_WEBUI_TOOLS, "parallel_tool_calls": True,
    "stream_options": {"include_usage": True},
}
OPEN_WEBUI_FOLLOW_UP: list[dict[str, Any]] = [
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_4f1c", "type": "function",
        "function": {"name": "search_web", "arguments": '{"query": "Eiffel Tower opening"}'}}]},
    {"role": "tool", "tool_call_id": "call_4f1c",
     "content": '[{"title": "Eiffel Tower", "snippet": "opened on 31 March 1889"}]'},
    {"role": "assistant", "content": "The Eiffel Tower opened in 1889."},
    {"role": "user", "content": [{"type": "text", "text": "And how tall is it?"}]},
]


def streamed_reply(cluster: Cluster, body: dict[str, Any]) -> tuple[str, list[Any], str]:
    """A streamed chat reply's text, tool-call deltas and finish reason."""
    text, calls, reason = "", list[Any](), ""
    with cluster.client.stream("POST", "/v1/chat/completions", timeout=300,
                               json={"model": cluster.model, **body}) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for choice in event["choices"]:
            text += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
            reason = choice["finish_reason"] or reason
    return text, calls, reason


def test_a_chat_ui_turn_with_its_built_in_tools_gets_an_answer(cluster: Cluster) -> None:
    text, calls, reason = streamed_reply(cluster, OPEN_WEBUI_TURN)
    assert text and not calls and reason in ("stop", "length")
    follow_up = {**OPEN_WEBUI_TURN,
                 "messages": OPEN_WEBUI_TURN["messages"] + OPEN_WEBUI_FOLLOW_UP}
    text, calls, reason = streamed_reply(cluster, follow_up)
    assert text and not calls and reason in ("stop", "length")


@pytest.fixture(scope="module")
def hermes_cluster(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("hermes"), real_model_dir,
                flags=["--tool-call-parser", "hermes"], timeout_s=REAL_LAUNCH_S) as running:
        yield running


def test_auto_with_the_hermes_parser_gives_well_formed_replies(hermes_cluster: Cluster) -> None:
    """The small model may or may not call: either way the reply is well formed (the parser
    itself is covered by tests/gateway/test_tool_parsers.py)."""
    with openai.OpenAI(base_url=f"{hermes_cluster.url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        for seed in (1, 2, 3):
            completion = client.chat.completions.create(
                model=hermes_cluster.model, messages=QUESTION, tools=[WEATHER, TIME],
                max_tokens=96, temperature=0.8, seed=seed)
            choice = completion.choices[0]
            if choice.message.tool_calls:
                assert choice.finish_reason in ("tool_calls", "length")
                for call in choice.message.tool_calls:
                    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
                    assert call.id.startswith("call_")
                    assert isinstance(json.loads(call.function.arguments), dict)
            else:
                assert choice.finish_reason in ("stop", "length")
                assert isinstance(choice.message.content, str)
    text, calls, reason = streamed_reply(hermes_cluster, {**OPEN_WEBUI_TURN, "seed": 4})
    assert text or calls
    assert reason in (("tool_calls", "length") if calls else ("stop", "length"))


def test_ollama_s_chat_with_tools_answers_as_chat_does(hermes_cluster: Cluster) -> None:
    """Through the official ollama client, greedy: the text and calls chat gives, whole and
    streamed alike, each call's arguments an object (the small model answers this one in text;
    the calls' shapes are tests/gateway/test_ollama_reply.py's)."""
    client = ollama.Client(host=hermes_cluster.url, timeout=300)
    asked: dict[str, Any] = {"model": hermes_cluster.model, "messages": QUESTION,
                             "tools": [WEATHER, TIME],
                             "options": {"temperature": 0, "num_predict": MAX_TOKENS}}
    whole = client.chat(**asked)
    pieces = list(client.chat(**asked, stream=True))
    calls = [(call.function.name, dict(call.function.arguments))
             for piece in pieces for call in piece.message.tool_calls or ()]
    assert calls == [(call.function.name, dict(call.function.arguments))
                     for call in whole.message.tool_calls or ()]
    assert "".join(p.message.content or "" for p in pieces) == whole.message.content
    with openai.OpenAI(base_url=f"{hermes_cluster.url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as openai_client:
        chat = openai_client.chat.completions.create(
            model=hermes_cluster.model, messages=QUESTION, tools=[WEATHER, TIME],
            max_tokens=MAX_TOKENS, temperature=0).choices[0].message
    assert calls == [(call.function.name, json.loads(call.function.arguments))
                     for call in chat.tool_calls or ()
                     if isinstance(call, ChatCompletionMessageFunctionToolCall)]
    assert whole.message.content == (chat.content or "")
