"""Anthropic's Messages API end to end on the real SmolLM2-135M-Instruct, through the official
anthropic client as its docs call it (`messages.create`, `messages.stream`,
`messages.count_tokens`): greedy output against transformers, stream events against the whole
message, limits and stop sequences, tool use and its round trip, a prefilled reply continued,
errors as the client raises them, and a stream left early freeing its KV blocks.
1 gateway + 1 prefill + 1 decode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest
import torch
from anthropic.types import Message, MessageParam, TextBlock, ToolParam, ToolUseBlock
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]
CLUSTER_CONTEXT = 1024  # the tests that fill it prefill 1,024 tokens, not 4,096

SYSTEM = "You are a helpful assistant. Answer in one sentence."
ASKED = "What is the capital of France?"
QUESTION: MessageParam = {"role": "user", "content": ASKED}
GREEDY = {"temperature": 0}  # the client has no sampling parameters of its own
WEATHER: ToolParam = {
    "name": "get_weather", "description": "Get current temperature for a given location.",
    "input_schema": {"type": "object", "properties": {"location": {"type": "string"}},
                     "required": ["location"]}}


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[anthropic.Anthropic]:
    """The official client, as its docs make it; no retries, so that a test sees every
    failure."""
    with anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0,
                             timeout=300) as made:
        yield made


def transformers_text(model_dir: Path, messages: list[dict[str, str]], max_tokens: int,
                      continued: bool = False) -> str:
    """transformers' greedy reply to `messages` under the template (`continued`: the last,
    the assistant's, left open)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=not continued, continue_final_message=continued,
        return_tensors="pt", return_dict=True)
    assert isinstance(encoded, BatchEncoding)
    ids = encoded["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return decode_text(tokenizer, out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def text_of(message: Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, TextBlock))


def prompt_tokens(message: Message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_a_greedy_message_equals_transformers(client: anthropic.Anthropic, cluster: Cluster,
                                              real_model_dir: Path) -> None:
    message = client.messages.create(model=cluster.model, system=SYSTEM, messages=[QUESTION],
                                     max_tokens=32, extra_body=GREEDY)
    expected = transformers_text(real_model_dir, [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": ASKED}], 32)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == cluster.model
    assert text_of(message) == expected and "Paris" in expected
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    counted = client.messages.count_tokens(model=cluster.model, system=SYSTEM,
                                           messages=[QUESTION])
    assert prompt_tokens(message) == counted.input_tokens
    assert 0 < message.usage.output_tokens <= 32


def test_the_stream_builds_the_same_message(client: anthropic.Anthropic,
                                            cluster: Cluster) -> None:
    request: dict[str, Any] = {"model": cluster.model, "messages": [QUESTION],
                               "max_tokens": 24}
    whole = client.messages.create(**request, extra_body=GREEDY)
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type != "text"]  # "text": the helper's
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta"
                     and e.delta.type == "text_delta")
    assert deltas == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final) == prompt_tokens(whole)
    # The prompt's usage as the stream starts is the one it ends with (the cache held part of
    # it: `whole` had just asked the same).
    started = next(e.message.usage for e in events if e.type == "message_start")
    ended = next(e.usage for e in events if e.type == "message_delta")
    assert (started.input_tokens, started.cache_read_input_tokens) == (
        ended.input_tokens, ended.cache_read_input_tokens)
    assert ended.cache_read_input_tokens


def test_max_tokens_and_stop_sequences_say_why_the_reply_stopped(
        client: anthropic.Anthropic, cluster: Cluster) -> None:
    story = client.messages.create(model=cluster.model, max_tokens=5, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Tell me a story."}])
    assert story.stop_reason == "max_tokens" and story.usage.output_tokens == 5
    stopped = client.messages.create(model=cluster.model, max_tokens=32, extra_body=GREEDY,
                                     messages=[QUESTION], stop_sequences=["Paris"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in text_of(stopped)


def test_max_tokens_past_the_context_stops_at_the_context_window(
        client: anthropic.Anthropic, cluster: Cluster) -> None:
    """As Anthropic's models do (and Claude Code asks for 32,000 tokens), where chat refuses."""
    window = cluster.client.get("/v1/models").json()["data"][0]["max_model_len"]
    words = " ".join(["hello"] * (window - 60))
    counted = client.messages.count_tokens(model=cluster.model, messages=[
        {"role": "user", "content": words}]).input_tokens
    assert window - 100 < counted < window
    message = client.messages.create(model=cluster.model, max_tokens=32000,
                                     messages=[{"role": "user", "content": words}],
                                     extra_body={**GREEDY, "ignore_eos": True})
    assert message.stop_reason == "model_context_window_exceeded"
    assert counted + message.usage.output_tokens == window


def test_a_forced_tool_use_and_its_result_round_trip(client: anthropic.Anthropic,
                                                     cluster: Cluster) -> None:
    asked: MessageParam = {"role": "user", "content": "What is the weather like in Paris?"}
    message = client.messages.create(model=cluster.model, max_tokens=100, extra_body=GREEDY,
                                     messages=[asked], tools=[WEATHER],
                                     tool_choice={"type": "any"})
    calls = [block for block in message.content if isinstance(block, ToolUseBlock)]
    assert calls and message.stop_reason == "tool_use"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER["input_schema"])
    answered = client.messages.create(
        model=cluster.model, max_tokens=32, extra_body=GREEDY, tools=[WEATHER], messages=[
            asked, {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "18 degrees and sunny"}
                                         for call in calls]}])
    assert answered.stop_reason in ("end_turn", "max_tokens") and text_of(answered)


def test_a_named_tool_streams_its_input(client: anthropic.Anthropic, cluster: Cluster) -> None:
    with client.messages.stream(model=cluster.model, max_tokens=100, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=[WEATHER], tool_choice={"type": "tool",
                                                              "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    [call] = final.content
    assert isinstance(call, ToolUseBlock) and final.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
               for e in events)


def test_a_prefilled_reply_is_continued(client: anthropic.Anthropic, cluster: Cluster,
                                        real_model_dir: Path) -> None:
    begun = "The capital of France is"
    message = client.messages.create(
        model=cluster.model, max_tokens=8, extra_body=GREEDY,
        messages=[QUESTION, {"role": "assistant", "content": begun}])
    expected = transformers_text(real_model_dir, [{"role": "user", "content": ASKED},
                                                  {"role": "assistant", "content": begun}], 8,
                                 continued=True)
    assert text_of(message) == expected and "Paris" in expected


def test_errors_raise_the_client_s_own_exceptions(client: anthropic.Anthropic,
                                                  cluster: Cluster) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-not-here", max_tokens=4, messages=[QUESTION])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model=cluster.model, max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "image input is not supported" in str(image.value)


def test_a_stream_left_early_frees_its_blocks(client: anthropic.Anthropic,
                                              cluster: Cluster) -> None:
    made_before = cluster.metric("raging_generation_tokens_total")
    with client.messages.stream(model=cluster.model, max_tokens=4000,
                                messages=[{"role": "user", "content": "Tell me a long story."}],
                                extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                wait_for(cluster.decoding, 30, "the message to decode")
                break
    wait_for(cluster.idle, 5, "the decode worker to free the message's blocks")
    # cut short, not run to the end of the context
    assert cluster.metric("raging_generation_tokens_total") - made_before < CLUSTER_CONTEXT / 2
