"""OpenAI's Responses API end to end on the real SmolLM2-135M-Instruct, through the official
openai client as its docs call it (`responses.create`, `responses.stream`, `retrieve`,
`delete`) and as raw SSE: greedy output against transformers and against the chat route,
stream events against the whole response, tool calls and their round trip, continued
conversations, formats, logprobs, what is kept, background responses (polled, cancelled,
deleted; streamed, left and followed again) and the input items listed back.
1 gateway + 1 prefill + 1 decode."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import agents
import jsonschema
import openai
import pytest
import torch
from openai.types.responses import (
    FunctionToolParam,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]


INSTRUCTIONS = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
WEATHER: FunctionToolParam = {
    "type": "function", "name": "get_weather", "strict": True,
    "description": "Get current temperature for a given location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"], "additionalProperties": False}}


def transformers_answer(model_dir: Path, messages: list[dict[str, str]],
                        max_tokens: int) -> tuple[str, int]:
    """transformers' greedy answer to `messages` under the template, and the prompt's length."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    assert isinstance(encoded, BatchEncoding)
    ids = encoded["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return decode_text(tokenizer, out[0, ids.shape[1]:].tolist(), skip_special_tokens=True), \
        ids.shape[1]


def message_of(response: Response) -> ResponseOutputMessage:
    """The response's one output item, its message."""
    [message] = response.output
    assert isinstance(message, ResponseOutputMessage)
    return message


def text_part(response: Response) -> ResponseOutputText:
    [part] = message_of(response).content
    assert isinstance(part, ResponseOutputText)
    return part


def chat_answer(client: openai.OpenAI, cluster: Cluster, messages: list[Any],
                **fields: Any) -> tuple[str | None, int]:
    """The chat route's greedy answer to `messages`, and its prompt tokens."""
    reply = client.chat.completions.create(model=cluster.model, messages=messages,
                                           temperature=0, **fields)
    assert reply.usage is not None
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def test_a_greedy_response_equals_transformers(
        client: openai.OpenAI, cluster: Cluster, real_model_dir: Path) -> None:
    response = client.responses.create(model=cluster.model, instructions=INSTRUCTIONS,
                                       input=QUESTION, max_output_tokens=32, temperature=0)
    expected, prompt_tokens = transformers_answer(real_model_dir, [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 32)
    assert response.status in ("completed", "incomplete")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == expected and "Paris" in expected
    assert message_of(response).role == "assistant"
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens
    assert response.usage.output_tokens <= 32
    assert response.instructions == INSTRUCTIONS and response.temperature == 0


def test_the_stream_builds_the_same_response(client: openai.OpenAI, cluster: Cluster) -> None:
    request: dict[str, Any] = {"model": cluster.model, "input": QUESTION,
                               "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    kept = client.responses.retrieve(final.id)
    assert kept.output_text == final.output_text and kept.status == final.status


def test_max_output_tokens_leaves_it_incomplete(client: openai.OpenAI, cluster: Cluster) -> None:
    response = client.responses.create(model=cluster.model, input="Tell me a long story.",
                                       max_output_tokens=5, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 5
    assert message_of(response).status == "incomplete"


def test_a_required_call_and_its_output_round_trip(
        client: openai.OpenAI, cluster: Cluster) -> None:
    asked = "What is the weather like in Paris today?"
    response = client.responses.create(model=cluster.model, input=asked, tools=[WEATHER],
                                       tool_choice="required", temperature=0,
                                       max_output_tokens=100)
    calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    results: list[Any] = [{"type": "function_call_output", "call_id": call.call_id,
                           "output": "14 degrees celsius, light rain"} for call in calls]
    # As the docs go on: the results, after the response they answer (kept by id) ...
    answer = client.responses.create(model=cluster.model, previous_response_id=response.id,
                                     input=results, tools=[WEATHER], temperature=0,
                                     max_output_tokens=40)
    # ... or after the whole conversation sent again; and as chat, it is the same prompt.
    conversation: list[Any] = [{"role": "user", "content": asked}, *calls, *results]
    again = client.responses.create(model=cluster.model, input=conversation, tools=[WEATHER],
                                    temperature=0, max_output_tokens=40, store=False)
    chat_text, chat_prompt = chat_answer(client, cluster, [
        {"role": "user", "content": asked},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        *[{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]}
          for r in results]],
        tools=[{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=40)
    assert answer.output_text and answer.output_text == again.output_text == chat_text
    assert answer.usage is not None and again.usage is not None
    assert answer.usage.input_tokens == again.usage.input_tokens == chat_prompt


def test_a_named_call_streams_its_arguments(client: openai.OpenAI, cluster: Cluster) -> None:
    with client.responses.stream(
            model=cluster.model, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = final.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert "".join(pieces) == done.arguments == call.arguments
    assert json.loads(call.arguments)["location"]


def test_previous_response_id_continues_the_conversation(
        client: openai.OpenAI, cluster: Cluster) -> None:
    said = "My name is Ana and I live in Lisbon."
    first = client.responses.create(model=cluster.model, input=said, temperature=0,
                                    max_output_tokens=30, instructions=INSTRUCTIONS)
    asked = "Where do I live?"
    second = client.responses.create(model=cluster.model, input=asked, temperature=0,
                                     max_output_tokens=30, previous_response_id=first.id)
    # Instructions are not carried over to the next response, as OpenAI has it.
    expected, prompt_tokens = chat_answer(client, cluster, [
        {"role": "user", "content": said}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": asked}], max_tokens=30)
    assert second.output_text == expected
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id


def test_store_false_keeps_nothing_and_delete_forgets(
        client: openai.OpenAI, cluster: Cluster) -> None:
    unkept = client.responses.create(model=cluster.model, input="Hi", max_output_tokens=4,
                                     store=False)
    assert unkept.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    kept = client.responses.create(model=cluster.model, input="Hi", max_output_tokens=4)
    assert kept.to_dict()["store"] is True
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=cluster.model, input="Hi", previous_response_id=kept.id)


def test_a_json_schema_format_is_followed(client: openai.OpenAI, cluster: Cluster) -> None:
    # Bounded, so that the small model's output ends within the limit.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "country": {"enum": ["France", "Spain"]}},
              "required": ["city", "country"], "additionalProperties": False}
    response = client.responses.create(
        model=cluster.model, input="Describe Paris as JSON.", temperature=0,
        max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_logprobs_are_the_chat_routes(client: openai.OpenAI, cluster: Cluster) -> None:
    response = client.responses.create(
        model=cluster.model, input=QUESTION, temperature=0, max_output_tokens=12,
        include=["message.output_text.logprobs"], top_logprobs=2)
    chat = client.chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=12, logprobs=True, top_logprobs=2)
    part = text_part(response)
    assert part.logprobs is not None
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    got = [(e.token, round(e.logprob, 4), len(e.top_logprobs)) for e in part.logprobs]
    want = [(e.token, round(e.logprob, 4), len(e.top_logprobs))
            for e in chat.choices[0].logprobs.content]
    assert got == want  # the stop token's too, as chat shows it
    assert "".join(e.token for e in part.logprobs).startswith(part.text)


def test_raw_sse_names_each_event_and_counts_the_route(cluster: Cluster) -> None:
    body = {"model": cluster.model, "input": "Hi", "max_output_tokens": 6, "stream": True}
    with cluster.client.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines
                if line.startswith("data: ")]
    assert names == [payload["type"] for payload in payloads]
    final = payloads[-1]["response"]
    assert payloads[-1]["type"] == f"response.{final['status']}"
    assert final["status"] in ("completed", "incomplete") and final["output"]
    assert final["usage"]["total_tokens"] == (final["usage"]["input_tokens"]
                                              + final["usage"]["output_tokens"])
    assert cluster.metric("raging_requests_total", 'outcome="ok",route="responses"') >= 1


def test_the_agents_sdk_runs_a_tool_calling_agent(cluster: Cluster) -> None:
    """The OpenAI Agents SDK over /v1/responses: the forced call of a Python function (which
    the SDK runs, sending its output back as a function_call_output item), then the answer;
    streamed too; then continued by `previous_response_id`."""
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"14 degrees celsius and light rain in {city}"

    agents.set_tracing_disabled(True)  # its traces would go to OpenAI
    client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    # The SDK's reset_tool_choice asks the second turn with tool_choice "auto" (text here); a
    # newline ends it, as the small model would otherwise run to the limit (an incomplete
    # streamed response is an error to the SDK).
    agent = agents.Agent(
        name="weather", instructions="Answer briefly from the tool's result.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=cluster.model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=300, extra_body={"stop": ["\n"]}))

    async def run() -> tuple[agents.RunResult, agents.RunResultStreaming, list[str],
                             agents.RunResult]:
        first = await agents.Runner.run(agent, "What is the weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "And in Oslo?")
        kinds: list[str] = [event.type async for event in streamed.stream_events()]
        again = await agents.Runner.run(agent, "Thanks.",
                                        previous_response_id=first.last_response_id)
        return first, streamed, kinds, again

    first, streamed, kinds, again = asyncio.run(run())
    assert len(called) == 3 and all(called)
    assert [type(item).__name__ for item in first.new_items] == [
        "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(first.final_output, str)
    assert {"raw_response_event", "run_item_stream_event"} <= set(kinds)
    assert isinstance(streamed.final_output, str) and isinstance(again.final_output, str)
    assert (first.last_response_id or "").startswith("resp_")


def finished(client: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Response:
    """A background response polled until it has ended."""
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued",
                                                                           "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.1)
    return response


def decoding_in_background(client: openai.OpenAI, cluster: Cluster) -> Response:
    """A long background response, once its decode worker runs it."""
    queued = client.responses.create(model=cluster.model, input="Tell me a long story.",
                                     max_output_tokens=4000, background=True,
                                     extra_body={"ignore_eos": True})
    wait_for(cluster.decoding, 30, "the response to decode")
    return queued


def test_a_background_response_is_polled_to_the_foreground_answer(
        client: openai.OpenAI, cluster: Cluster) -> None:
    fields: dict[str, Any] = {"model": cluster.model, "input": QUESTION, "temperature": 0,
                              "instructions": INSTRUCTIONS, "max_output_tokens": 24}
    foreground = client.responses.create(**fields)
    queued = client.responses.create(**fields, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    response = finished(client, queued.id)
    assert response.background and response.status == foreground.status
    assert response.output_text == foreground.output_text
    assert response.usage is not None and foreground.usage is not None
    assert response.usage.output_tokens == foreground.usage.output_tokens
    continued = client.responses.create(model=cluster.model, input="Why?", temperature=0,
                                        max_output_tokens=8, previous_response_id=queued.id)
    assert continued.previous_response_id == queued.id and continued.output_text


def test_cancelling_a_background_response_aborts_it_on_the_workers(
        client: openai.OpenAI, cluster: Cluster) -> None:
    queued = decoding_in_background(client, cluster)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent
    wait_for(cluster.idle, 5, "the decode worker to free the response's blocks")
    foreground = client.responses.create(model=cluster.model, input="Hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="background true"):
        client.responses.cancel(foreground.id)


def test_a_deleted_background_response_is_cancelled_first(
        client: openai.OpenAI, cluster: Cluster) -> None:
    queued = decoding_in_background(client, cluster)
    client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)
    wait_for(cluster.idle, 5, "the decode worker to free the response's blocks")


def test_a_background_stream_is_followed_again_from_any_event(
        client: openai.OpenAI, cluster: Cluster) -> None:
    """The client that made it leaves early; the response runs on; a later GET follows it
    from the next event, as the official client resumes one (`starting_after`)."""
    fields: dict[str, Any] = {"model": cluster.model, "input": QUESTION, "temperature": 0,
                              "instructions": INSTRUCTIONS, "max_output_tokens": 24}
    foreground = client.responses.create(**fields)
    first = []
    with client.responses.create(**fields, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break  # gone after the first text
    created = first[0]
    assert created.type == "response.created" and created.response.status == "queued"
    assert [e.type for e in first[1:3]] == ["response.queued", "response.in_progress"]
    response_id, seen = created.response.id, first[-1].sequence_number
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen))
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1].type == "response.completed"
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == foreground.output_text == rest[-1].response.output_text
    again = list(client.responses.retrieve(response_id, stream=True))  # from the start, ended
    assert [e.sequence_number for e in again] == list(range(len(first) + len(rest)))
    assert finished(client, response_id).output_text == text
    with client.responses.stream(response_id=response_id) as replayed:  # the client's helper
        assert replayed.get_final_response().output_text == text
    with pytest.raises(openai.BadRequestError, match="background and stream"):
        list(client.responses.retrieve(foreground.id, stream=True))
    client.responses.delete(response_id)
    with pytest.raises(openai.NotFoundError):
        list(client.responses.retrieve(response_id, stream=True))


def test_a_cancelled_background_stream_ends_its_followers(
        client: openai.OpenAI, cluster: Cluster) -> None:
    stream = client.responses.create(model=cluster.model, input="Tell me a long story.",
                                     max_output_tokens=4000, background=True, stream=True,
                                     extra_body={"ignore_eos": True})
    events = iter(stream)
    response_id = next(events).response.id  # type: ignore[union-attr]
    # the cancel comes once text has streamed (any() reads the events up to the first delta)
    assert any(event.type == "response.output_text.delta" for event in events)
    wait_for(cluster.decoding, 30, "the response to decode")
    assert client.responses.cancel(response_id).status == "cancelled"
    kinds = [event.type for event in events]  # ends: the log ended with the cancel
    assert "response.completed" not in kinds
    assert client.responses.retrieve(response_id).status == "cancelled"
    wait_for(cluster.idle, 5, "the decode worker to free the response's blocks")


def test_input_items_list_a_responses_own_input_a_page_at_a_time(
        client: openai.OpenAI, cluster: Cluster) -> None:
    first = client.responses.create(model=cluster.model, input="Hi", max_output_tokens=4)
    said = [{"role": "user", "content": f"Message {i}."} for i in range(5)]
    response = client.responses.create(model=cluster.model, input=said,  # type: ignore[arg-type]
                                       max_output_tokens=4, previous_response_id=first.id)
    newest_first = client.responses.input_items.list(response.id)
    texts = [json.loads(item.to_json())["content"][0]["text"] for item in newest_first.data]
    assert texts == [f"Message {i}." for i in (4, 3, 2, 1, 0)]  # only its own input
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert page.has_more and len(page.data) == 2
    every = list(client.responses.input_items.list(response.id, order="asc", limit=2))
    assert [item.id for item in every] == [item.id for item in newest_first.data[::-1]]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_none")
