"""Ollama's API end to end on the real SmolLM2-135M-Instruct, through the official `ollama`
client: `chat` whole and streamed (the same greedy text as /v1/chat/completions), `generate`
templated, raw and continued from its `context`, a JSON schema `format`, logprobs, an earlier
call and its tool result in the prompt, the listing routes (`list`, `show`, `ps`, `version`),
loading, Ollama's errors, and a stream left early freeing its KV blocks. 1 gateway + 1 prefill
+ 1 decode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from tests.e2e.cluster import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

QUESTION = [{"role": "user", "content": "Describe Paris in a few sentences."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[ollama.Client]:
    made = ollama.Client(host=cluster.url, timeout=120)
    yield made
    made._client.close()


def openai_chat(cluster: Cluster, messages: list[dict[str, Any]], **fields: Any
                ) -> dict[str, Any]:
    reply = cluster.client.post("/v1/chat/completions", json={
        "messages": messages, "temperature": 0, "max_tokens": 12, **fields})
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def test_a_greedy_chat_is_the_openai_route_s(client: ollama.Client, cluster: Cluster) -> None:
    reply = client.chat(model=cluster.model, messages=QUESTION, options=GREEDY)
    openai = openai_chat(cluster, QUESTION)
    assert reply.message.content == openai["choices"][0]["message"]["content"]
    assert reply.message.role == "assistant" and reply.done and reply.done_reason == "length"
    assert reply.eval_count == 12
    assert reply.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert reply.total_duration and reply.eval_duration and reply.prompt_eval_duration
    assert reply.total_duration >= reply.prompt_eval_duration
    assert reply.model == cluster.model


def test_the_stream_adds_up_to_the_whole(client: ollama.Client, cluster: Cluster) -> None:
    *pieces, last = client.chat(model=f"{cluster.model}:latest", messages=QUESTION,
                                options=GREEDY, stream=True)
    assert pieces and not any(piece.done for piece in pieces) and last.done
    whole = client.chat(model=cluster.model, messages=QUESTION, options=GREEDY)
    assert "".join(piece.message.content or "" for piece in pieces) == whole.message.content
    assert (last.done_reason, last.eval_count, last.message.content) == ("length", 12, "")
    assert last.model == f"{cluster.model}:latest"  # the name the request gave


def test_every_reply_has_a_rate(client: ollama.Client, cluster: Cluster) -> None:
    """eval_count over eval_duration is the rate, a reply of one token's too."""
    for most in (1, 2, 8):
        reply = client.chat(model=cluster.model, messages=QUESTION,
                            options={"temperature": 0, "num_predict": most})
        assert reply.eval_count == most and reply.eval_duration and reply.eval_duration > 0


def test_generate_under_the_template_raw_and_from_its_context(client: ollama.Client,
                                                              cluster: Cluster) -> None:
    templated = client.generate(model=cluster.model, prompt=QUESTION[0]["content"],
                                options=GREEDY)
    assert templated.response == client.chat(model=cluster.model, messages=QUESTION,
                                             options=GREEDY).message.content
    assert templated.context is not None
    rendered = cluster.client.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert list(templated.context[:len(rendered)]) == rendered
    assert len(templated.context) == len(rendered) + 12
    raw = client.generate(model=cluster.model, prompt="The capital of France is", raw=True,
                          options=GREEDY)
    completion = cluster.client.post("/v1/completions", json={
        "prompt": "The capital of France is", "temperature": 0, "max_tokens": 12}).json()
    assert raw.response == completion["choices"][0]["text"]
    follow = client.generate(model=cluster.model, prompt="And of Italy?",
                             context=templated.context, options=GREEDY)
    again = cluster.client.post("/tokenize", json={
        "messages": [{"role": "user", "content": "And of Italy?"}]}).json()["tokens"]
    assert follow.prompt_eval_count == len(templated.context) + len(again)
    assert list(follow.context or [])[:len(templated.context)] == list(templated.context)


def test_a_json_schema_format_holds_the_output(client: ollama.Client, cluster: Cluster) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    reply = client.chat(model=cluster.model, messages=QUESTION, format=schema,
                        options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(reply.message.content or "")) == {"city"}
    anything = client.chat(model=cluster.model, messages=QUESTION, format="json",
                           options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(anything.message.content or ""), dict)


def test_logprobs_of_each_token(client: ollama.Client, cluster: Cluster) -> None:
    reply = client.chat(model=cluster.model, messages=QUESTION, logprobs=True,
                        top_logprobs=2, options={"temperature": 0, "num_predict": 4})
    assert reply.logprobs is not None and len(reply.logprobs) == 4
    assert "".join(entry.token for entry in reply.logprobs) == reply.message.content
    first = reply.logprobs[0]
    assert first.top_logprobs is not None and len(first.top_logprobs) == 2
    assert first.top_logprobs[0].token == first.token and first.logprob <= 0


def test_an_earlier_call_and_its_result_reach_the_template(client: ollama.Client,
                                                           cluster: Cluster) -> None:
    """Ollama names no call: the tool message answers the earlier call of its tool_name. The
    prompt is the one the OpenAI route renders of the same turns (no tools offered: this
    cluster runs no tool-call parser)."""
    call = {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages: list[dict[str, Any]] = [
        *QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_name": "weather", "content": "Sunny, 21 C"}]
    reply = client.chat(model=cluster.model, messages=messages, options=GREEDY)
    openai_messages: list[dict[str, Any]] = [
        *QUESTION, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1_0", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "Sunny, 21 C"}]
    openai = openai_chat(cluster, openai_messages)
    assert reply.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert reply.message.content == openai["choices"][0]["message"]["content"]


def test_the_listing_routes_describe_the_served_model(client: ollama.Client,
                                                      cluster: Cluster) -> None:
    [listed] = client.list().models
    assert listed.model == f"{cluster.model}:latest"
    assert listed.details is not None and listed.details.family == "llama"
    assert listed.details.parameter_size == "135M" and listed.size and listed.size > 10**8
    shown = client.show(listed.model or "")
    context = cluster.client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == context
    assert shown.modelinfo["llama.block_count"] == 30
    assert shown.capabilities == ["completion"] and "<|im_start|>" in (shown.template or "")
    [running] = client.ps().models
    assert running.model == listed.model and running.context_length == context
    assert cluster.client.get("/api/version").json()["version"]


def test_nothing_to_generate_loads_the_model(client: ollama.Client, cluster: Cluster) -> None:
    assert client.chat(model=cluster.model, messages=[]).done_reason == "load"
    assert client.generate(model=cluster.model, keep_alive=0).done_reason == "unload"


def test_errors_are_ollama_s(client: ollama.Client, cluster: Cluster) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3:8b", messages=QUESTION)
    assert missing.value.status_code == 404 and "llama3:8b" in missing.value.error
    with pytest.raises(ollama.ResponseError) as thinking:
        client.chat(model=cluster.model, messages=QUESTION, think=True)
    assert thinking.value.status_code == 400 and "thinking" in thinking.value.error
    bad = cluster.client.post("/api/chat", json={"messages": QUESTION,
                                                 "options": {"num_predict": 0}})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    assert "options.num_predict" in bad.json()["error"]
    images = cluster.client.post("/api/generate", json={"prompt": "What is this?",
                                                        "images": ["aGk="]})
    assert images.status_code == 400 and "image" in images.json()["error"]
    assert cluster.client.post("/api/pull", json={"model": "x"}).json() == {
        "error": "no route /api/pull"}


def test_a_stream_left_early_frees_its_blocks(cluster: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "options": {"num_predict": 4000}}
    with httpx.stream("POST", f"{cluster.url}/api/chat", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line:
                wait_for(cluster.decoding, 30, "the chat to decode")
                break
    wait_for(cluster.idle, 5, "the decode worker to free the chat's blocks")
