"""gateway.params: the generation parameters of a validated request, what it leaves out taken
from the defaults."""

from __future__ import annotations

from typing import Any

import pytest

from core.config import GenerationDefaults
from core.messages import JSON_OBJECT
from gateway.chat_request import parse_chat_request
from gateway.params import GenerationParams, generation_params
from gateway.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatMessage,
    parse_completion_request,
)
from tests.gateway.test_protocol import chat, completion, raises_400

# GenerationParams' own defaults
NEUTRAL = GenerationDefaults(temperature=1.0, top_p=1.0, repetition_penalty=1.0)


@pytest.mark.parametrize(("parse", "body"), [
    (parse_chat_request, chat(min_tokens=9, max_tokens=8)),
    (parse_chat_request, chat(min_tokens=9, max_tokens=20, max_completion_tokens=8)),
    (parse_completion_request, completion(min_tokens=17)),  # over the default max_tokens, 16
])
def test_min_tokens_over_max_tokens_is_400(parse: Any, body: bytes) -> None:
    err = raises_400(lambda b: generation_params(parse(b)), body)
    assert err.param == "min_tokens"
    assert "min_tokens" in err.message


def test_minimal_chat_request_defaults() -> None:
    req = parse_chat_request(chat())
    assert req.messages == [ChatMessage(role="user", content="Hello!")]
    assert generation_params(req) == GenerationParams(
        max_tokens=None, default_max_tokens=2048, temperature=0.2, top_p=0.9, top_k=0,
        seed=None, stop=(), stop_token_ids=(), ignore_eos=False, include_usage=False,
        stream=False, repetition_penalty=1.1,
    )  # fmt: skip


def test_full_chat_request_converts() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    body = chat(
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
        max_tokens=50, max_completion_tokens=20, temperature=0, top_p=0.9, top_k=40, n=1,
        stream=True, stream_options={"include_usage": True}, stop="END", stop_token_ids=[7, 9],
        seed=1234, ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True,
        top_logprobs=5, response_format={"type": "text"}, user="u1", tools=[],
        metadata={"k": "v"}, store=False, parallel_tool_calls=True, tool_choice="none",
        service_tier="auto", logit_bias={}, min_tokens=20, repetition_penalty=1.3,
    )  # fmt: skip
    req = parse_chat_request(body)
    assert req.messages[1].content == "one\ntwo"
    assert generation_params(req) == GenerationParams(
        max_tokens=20, temperature=0.0, top_p=0.9, top_k=40, seed=1234, stop=("END",),
        stop_token_ids=(7, 9), ignore_eos=True, include_usage=True, stream=True,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_tokens=20,
        logprobs=5, default_max_tokens=2048,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"top_k": -1}, {"top_k": 0}),
        ({"top_k": 0}, {"top_k": 0}),
        ({"temperature": None, "top_p": None}, {}),
        ({"stop": ["a", "bc"]}, {"stop": ("a", "bc")}),
        ({"stop": None}, {}),
        ({"stream": True}, {"stream": True}),
        ({"stream": True, "stream_options": {}}, {"stream": True}),
        ({"stream": True, "stream_options": {"include_usage": False}}, {"stream": True}),
        ({"stream": True, "stream_options": {"include_usage": True,
                                             "continuous_usage_stats": True}},
         {"stream": True, "include_usage": True, "continuous_usage": True}),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
         {"stream": True}),  # as vLLM: only with include_usage
        ({"max_tokens": 7}, {"max_tokens": 7}),
        ({"seed": -(2**63)}, {"seed": -(2**63)}),
        ({"temperature": 2}, {"temperature": 2.0}),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"logprobs": True, "top_logprobs": 20}, {"logprobs": 20}),
        ({"logprobs": False, "top_logprobs": 0}, {}),
        ({"logprobs": None, "top_logprobs": None}, {}),
        ({"min_tokens": 0, "repetition_penalty": None}, {}),
        ({"min_tokens": 5}, {"min_tokens": 5}),  # no max_tokens: the context limit wins
        ({"repetition_penalty": 2}, {"repetition_penalty": 2.0}),
        ({"presence_penalty": -2, "frequency_penalty": 2},
         {"presence_penalty": -2.0, "frequency_penalty": 2.0}),
        ({"min_p": 0.05}, {"min_p": 0.05}),
        ({"repeat_penalty": 1.1}, {"repetition_penalty": 1.1}),
        ({"repeat_penalty": 1.1, "repetition_penalty": 1.1}, {"repetition_penalty": 1.1}),
        ({"skip_special_tokens": False}, {"skip_special_tokens": False}),
        ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True}),
        ({"allowed_token_ids": [3, 1]}, {"allowed_token_ids": (3, 1)}),
        ({"logit_bias": {"7": 100, "9": -5.5, "3": 0}}, {"logit_bias": ((7, 100.0), (9, -5.5))}),
        ({"bad_words": ["no", "never"]}, {"bad_words": ("no", "never")}),
        ({"priority": -3, "chat_template_kwargs": {"x": 1}}, {"priority": -3}),
        ({"min_tokens": 3000}, {"min_tokens": 3000, "default_max_tokens": 3000}),
    ],
)
def test_chat_params(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    params = generation_params(parse_chat_request(chat(**fields)), NEUTRAL)
    assert params == GenerationParams(**{"default_max_tokens": NEUTRAL.max_tokens, **expected})


def test_completion_defaults_and_params() -> None:
    req = parse_completion_request(completion())
    assert generation_params(req).max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    req = parse_completion_request(
        completion(max_tokens=None, echo=False, best_of=1, suffix="", stop=["\n"], seed=3)
    )
    params = generation_params(req)
    assert (params.max_tokens, params.stop, params.seed) == (None, ("\n",), 3)
    assert params.logprobs is None
    for logprobs in (0, 5):
        req = parse_completion_request(completion(logprobs=logprobs, min_tokens=16))
        assert (generation_params(req).logprobs, generation_params(req).min_tokens) == (
            logprobs, 16)
    req = parse_completion_request(completion(response_format={"type": "json_object"}))
    assert generation_params(req).grammar == JSON_OBJECT


@pytest.mark.parametrize(("raging", "timing"), [
    (None, False), ({}, False), ({"timing": False}, False), ({"timing": None}, False),
    ({"timing": True}, True),
])
def test_the_raging_extension_asks_for_the_timing_breakdown(raging: Any, timing: bool) -> None:
    for parse, body in ((parse_chat_request, chat(raging=raging)),
                        (parse_completion_request, completion(raging=raging))):
        assert generation_params(parse(body)).timing is timing
