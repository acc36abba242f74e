"""A reasoning model's thinking told from its answer (`--reasoning-parser qwen3`) on every API,
end to end: a tiny random Llama made to think by a regular expression (`guided_regex`, which
`grammar_in_reasoning` applies to the thinking too), so that every output opens with `<think>`,
closes it, and answers; whole and streamed, through the official openai and anthropic clients.
Then, as by default, a grammar that waits out the thought and holds the answer.
1 gateway + 1 prefill + 1 decode."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import pytest
from anthropic.types import MessageParam, TextBlock, ThinkingBlock, ThinkingConfigParam
from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from openai.types.responses import ResponseOutputMessage, ResponseReasoningItem
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch

pytestmark = pytest.mark.e2e

THOUGHT = "[a-z]{3,8}"
ANSWER = "yes|no"
FORCED: dict[str, Any] = {"guided_regex": f"<think>\n{THOUGHT}\n</think>\n\n({ANSWER})",
                          "temperature": 1.0, "seed": 5}
ASKED: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Is it raining?"}]
ASKED_ANTHROPIC: list[MessageParam] = [{"role": "user", "content": "Is it raining?"}]
MARKERS = [49152, 49153]  # <think> and </think>, added to the tiny model's vocabulary


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    gateway = {**TEST_CONFIG["gateway"], "reasoning_parser": "qwen3",
               "grammar_in_reasoning": True}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir,
                config={**TEST_CONFIG, "gateway": gateway}) as running:
        yield running


def reasoning_tokens(reply: ChatCompletion) -> int:
    """The reply's reasoning tokens, as its usage counts them."""
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    tokens = reply.usage.completion_tokens_details.reasoning_tokens
    assert tokens is not None
    return tokens


def tokens_writing(reply: ChatCompletion, text: str) -> int:
    """How many of the reply's tokens (by its logprobs) it took to write `text`, its start."""
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    written = ""
    for count, entry in enumerate(logprobs.content, 1):
        written += entry.token
        if len(written) >= len(text):
            assert written.startswith(text)
            return count
    raise AssertionError(f"{text!r} is not the start of the output {written!r}")


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0) as made:
        yield made


def thought_and_answer(reasoning: str, answer: str) -> tuple[str, str]:
    """Checked for the forced shape: the thinking between the markers, the answer after."""
    assert re.fullmatch(f"\n{THOUGHT}\n", reasoning), reasoning
    assert re.fullmatch(ANSWER, answer), answer
    return reasoning, answer


def test_chat_gives_reasoning_content_whole_and_streamed(client: OpenAI,
                                                         cluster: Cluster) -> None:
    reply = client.chat.completions.create(model=cluster.model, messages=ASKED,
                                           max_tokens=40, extra_body=FORCED, logprobs=True)
    message = reply.choices[0].message
    whole = thought_and_answer(getattr(message, "reasoning_content", ""), message.content or "")
    assert getattr(message, "reasoning", "") == whole[0]  # vLLM's name for it too
    assert reasoning_tokens(reply) == tokens_writing(reply, f"<think>{whole[0]}</think>")
    stream = client.chat.completions.create(model=cluster.model, messages=ASKED,
                                            max_tokens=40, extra_body=FORCED, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(reply)
    streamed = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                "".join(d.content or "" for d in deltas))
    assert streamed == whole  # the same seed: the same draws


def test_messages_give_a_thinking_block_where_thinking_is_on(cluster: Cluster) -> None:
    thinking: ThinkingConfigParam = {"type": "enabled", "budget_tokens": 1024}
    with anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0) as made:
        message = made.messages.create(model=cluster.model, max_tokens=40, thinking=thinking,
                                       messages=ASKED_ANTHROPIC, extra_body=FORCED)
        with made.messages.stream(model=cluster.model, max_tokens=40, messages=ASKED_ANTHROPIC,
                                  thinking=thinking, extra_body=FORCED) as stream:
            final = stream.get_final_message()
        plain = made.messages.create(model=cluster.model, max_tokens=40,
                                     messages=ASKED_ANTHROPIC, extra_body=FORCED)
    [answer] = plain.content  # thinking off: the answer alone, as Anthropic's
    assert isinstance(answer, TextBlock) and re.fullmatch(ANSWER, answer.text)
    shown: list[tuple[str, str]] = []
    for reply in (message, final):
        thought, text = reply.content
        assert isinstance(thought, ThinkingBlock) and isinstance(text, TextBlock)
        shown.append(thought_and_answer(thought.thinking, text.text))
    assert shown[0] == shown[1]  # the same seed: the same draws


def test_responses_give_a_reasoning_item(client: OpenAI, cluster: Cluster) -> None:
    response = client.responses.create(model=cluster.model, input="Is it raining?",
                                       max_output_tokens=40, extra_body=FORCED)
    reasoning, message = response.output
    assert isinstance(reasoning, ResponseReasoningItem)
    assert isinstance(message, ResponseOutputMessage)
    assert reasoning.content is not None
    thought_and_answer(reasoning.content[0].text, response.output_text)
    chat = client.chat.completions.create(model=cluster.model, messages=ASKED, max_tokens=40,
                                          extra_body=FORCED)  # the same prompt and seed
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens(chat) > 0


@pytest.fixture(scope="module")
def waiting(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[OpenAI]:
    """A client of a cluster whose grammars wait out the thought (the default)."""
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"], "reasoning_parser": "qwen3"}}
    with (launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config) as running,
          OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0) as made):
        yield made


def test_a_grammar_waits_out_the_thought_and_holds_the_answer(
        waiting: OpenAI, tokenizer: PreTrainedTokenizerBase) -> None:
    """The prompt opens the thought; the model may only write pieces of `</think>` (so that it
    closes it by chance), yet its answer is the grammar's."""
    pieces = tokenizer.encode("</think>")
    assert len(pieces) == 3  # "</", "think", ">": the end marker over three tokens
    opened: list[ChatCompletionMessageParam] = [
        *ASKED, {"role": "assistant", "content": "<think>\n"}]
    reply = waiting.chat.completions.create(
        model=waiting.models.list().data[0].id, messages=opened, max_tokens=300, seed=3,
        temperature=1.0, extra_body={"continue_final_message": True,
                                     "add_generation_prompt": False,
                                     "allowed_token_ids": pieces, "guided_regex": ANSWER},
        logprobs=True)
    message = reply.choices[0].message
    assert re.fullmatch("[</think>]+", getattr(message, "reasoning_content", "")), message
    assert re.fullmatch(ANSWER, message.content or ""), message
    assert reply.choices[0].finish_reason == "stop"
    assert reasoning_tokens(reply) == tokens_writing(
        reply, f"{message.reasoning_content}</think>")  # type: ignore[attr-defined]


def test_a_model_that_does_not_think_is_held_from_its_first_token(waiting: OpenAI) -> None:
    reply = waiting.chat.completions.create(
        model=waiting.models.list().data[0].id, messages=ASKED, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"]}}})
    message = reply.choices[0].message
    assert not getattr(message, "reasoning_content", None), message
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(message.content or "")["answer"] in ("yes", "no")


def test_ollama_s_chat_gives_the_thought_in_thinking(waiting: OpenAI) -> None:
    """The prompt opens the thought and the tiny model does not close it: all it writes is
    thought, in `thinking`, whole and streamed, as chat's reasoning_content for the seed."""
    model = waiting.models.list().data[0].id
    opened = [*ASKED, {"role": "assistant", "content": "<think>\n"}]
    sampled = {"temperature": 1.0, "seed": 3, "num_predict": 6}
    client = ollama.Client(host=str(waiting.base_url).removesuffix("/v1/"))
    reply = client.chat(model=model, messages=opened, think=True, options=sampled)
    assert reply.message.thinking and reply.message.content == ""
    pieces = list(client.chat(model=model, messages=opened, think=True, options=sampled,
                              stream=True))
    assert "".join(piece.message.thinking or "" for piece in pieces) == reply.message.thinking
    chat = waiting.chat.completions.create(
        model=model, messages=[*ASKED, {"role": "assistant", "content": "<think>\n"}],
        max_tokens=6, seed=3, temperature=1.0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert getattr(chat.choices[0].message, "reasoning_content", "") == reply.message.thinking


@pytest.fixture(scope="module")
def thinker(make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[OpenAI]:
    """A client of a cluster (grammars waiting out the thought) whose tiny model has whole
    `<think>` and `</think>` tokens, as Qwen3's vocabulary does."""
    folder = make_tiny_model(vocab_size=49154)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == MARKERS
    tokenizer.save_pretrained(folder)
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"], "reasoning_parser": "qwen3"}}
    with (launch(tmp_path_factory.mktemp("run"), folder, config=config) as running,
          OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0) as made):
        yield made


def test_a_first_think_token_opens_a_thought_the_grammar_waits_out(thinker: OpenAI) -> None:
    """Qwen3's hybrid way: the prompt leaves the thought closed, the output opens it. Both
    markers drawn first wherever allowed (a bias), so the first token opens the thought rather
    than the grammar's answer, and the thought ends when `</think>` comes up."""
    bias = {str(token): 100 for token in MARKERS}
    reply = thinker.chat.completions.create(
        model=thinker.models.list().data[0].id, messages=ASKED, max_tokens=40, seed=1,
        temperature=1.0, logit_bias=bias, extra_body={"guided_regex": ANSWER})
    message = reply.choices[0].message
    assert re.fullmatch("(<think>)*", getattr(message, "reasoning_content", "")), message
    assert re.fullmatch(ANSWER, message.content or ""), message
    assert reply.choices[0].finish_reason == "stop"
    assert reasoning_tokens(reply) >= 2  # the markers at least: the output did think
