"""llama.cpp's /completion body read as a /v1/completions request: its names, its -1s, its
logit_bias shapes, its grammar and schema; what it cannot mean is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.messages import Grammar
from gateway.errors import APIError
from gateway.llamacpp_request import BANNED, LlamaCompletionRequest, parse_llamacpp_request
from gateway.params import generation_params


def parsed(**fields: Any) -> LlamaCompletionRequest:
    return parse_llamacpp_request(json.dumps({"prompt": "Hi", **fields}).encode())


def test_llama_cpp_names_become_the_completion_s() -> None:
    body = parsed(n_predict=12, temperature=0.5, top_k=40, top_p=0.9, min_p=0.05,
                  repeat_penalty=1.2, presence_penalty=0.1, frequency_penalty=0.2, seed=7,
                  stop=["\n\n"], ignore_eos=True, stream=True, n_probs=3,
                  cache_prompt=True, id_slot=2)
    params = generation_params(body.completion_request({}))
    assert (body.predict, params.temperature, params.top_k, params.top_p, params.min_p,
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
            params.seed, params.stop, params.ignore_eos, params.stream, params.logprobs) == (
        12, 0.5, 40, 0.9, 0.05, 1.2, 0.1, 0.2, 7, ("\n\n",), True, True, 3)


def test_minus_one_means_up_to_the_cap_and_a_fresh_seed() -> None:
    body = parsed(n_predict=-1)
    params = generation_params(body.completion_request({}))
    assert body.predict is None
    assert params.max_tokens is None and params.seed is None and params.logprobs is None


@pytest.mark.parametrize(("fields", "predict"), [
    ({"n_predict": 12}, 12), ({"max_tokens": 8}, 8), ({"n_predict": 12, "max_tokens": 8}, 12),
    ({"n_predict": -1, "max_tokens": 8}, None), ({}, None)])
def test_n_predict_else_max_tokens_caps_the_length(fields: dict[str, Any],
                                                    predict: int | None) -> None:
    """A cap, which the route applies: the completion's own max_tokens stays unset, so that
    it stops at the context rather than being refused."""
    body = parsed(**fields)
    assert body.predict == predict
    assert body.completion_request({}).max_tokens is None


def test_a_temperature_at_or_below_zero_is_greedy() -> None:
    assert generation_params(parsed(temperature=-1.0).completion_request({})).temperature == 0


def test_token_ids_are_a_prompt_too() -> None:
    assert parsed(prompt=[1, 2, 3]).completion_request({}).prompt == [[1, 2, 3]]


def test_a_list_of_prompts_is_several() -> None:
    body = parsed(prompt=["Hi", [1, 2, 3]])
    assert body.prompt == ["Hi", [1, 2, 3]]
    assert body.completion_request({}).prompt == ["Hi", [1, 2, 3]]


def test_a_gbnf_grammar_and_a_json_schema_are_structured_output() -> None:
    gbnf = 'root ::= "yes" | "no"'
    assert generation_params(parsed(grammar=gbnf).completion_request({})).grammar == Grammar(
        "ebnf", gbnf)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = generation_params(parsed(json_schema=schema).completion_request({})).grammar
    assert grammar is not None and grammar.kind == "json_schema"
    assert json.loads(grammar.text) == schema


@pytest.mark.parametrize(("bias", "entries"), [
    ([[15043, 1.0]], [(15043, 1.0)]),
    ([[15043, False]], [(15043, BANNED)]),
    ({"15043": -2.5}, [(15043, -2.5)]),
    ([["Hello, World!", -0.5]], [("Hello, World!", -0.5)]),
    ([["42", 1.0]], [("42", 1.0)]),  # in a list, a string is text, digits or not
])
def test_every_logit_bias_shape_is_read(bias: Any, entries: list[tuple[int | str, float]]
                                        ) -> None:
    body = parsed(logit_bias=bias)
    assert body.bias_entries() == entries
    resolved = {key: value for key, value in entries if isinstance(key, int)}
    params = generation_params(body.completion_request(resolved))
    assert params.logit_bias == tuple(resolved.items())


@pytest.mark.parametrize(("fields", "param"), [
    ({"n_predict": -2}, "n_predict"),
    ({"seed": -2}, "seed"),
    ({"logit_bias": [[15043, True]]}, "logit_bias"),
    ({"logit_bias": [[15043, 500]]}, "logit_bias"),
    ({"logit_bias": [[1.5, 1.0]]}, "logit_bias"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "Hi"]}, "prompt"),  # a prompt of text and ids mixed is not served
    ({"prompt": ["Hi"] * 17}, "prompt"),  # as /v1/completions: at most 16 at once
    ({"temperature": 3.0}, "temperature"),
    ({"n_probs": 99}, "n_probs"),
    ({"json_schema": {"type": "bogus"}}, "json_schema"),  # checked as the completion's
    ({"grammar": "root ::= ("}, "grammar"),
])
def test_what_cannot_be_served_is_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        parsed(**fields).completion_request({})
    assert info.value.status == 400 and info.value.param == param
