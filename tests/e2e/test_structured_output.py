"""Structured output end to end, through the official OpenAI client, on a tiny random Llama:
1 gateway + 1 prefill + 1 decode real processes. A random model writes nonsense, so whatever
JSON comes back valid (or matches a regular expression, is one of a choice, follows an EBNF
grammar) is the grammar's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from openai.types.chat.completion_create_params import ResponseFormat

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, wait_for
from tests.engine.sampling.test_grammar import SCHEMA

pytestmark = pytest.mark.e2e

PROMPTS = ["Describe a pet", "Once upon a time", "def fibonacci(n):", "日本の首都は"]
SAMPLING: list[dict[str, Any]] = [{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                  {"temperature": 0.8, "top_p": 0.9, "seed": 11}]
MAX_TOKENS = 300  # room for the longest value SCHEMA allows (a pet: bounded strings, enums)
JSON_SCHEMA_FORMAT: ResponseFormat = {
    "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Grammar tables built once each worker is ready, as shipped."""
    config = {**TEST_CONFIG, "engine": {"grammar_tables_at_start": True}}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config) as running:
        yield running


def test_each_worker_builds_its_grammar_tables_once_ready(cluster: Cluster) -> None:
    """Before any request (this module's first test): the first grammar will not wait."""
    for name in ("prefill-0", "decode-0"):
        wait_for(partial(tables_built, cluster, name), 120, f"{name}'s grammar tables")
        assert " prompt tokens" not in cluster.log(name)  # no request came first


def tables_built(cluster: Cluster, worker: str) -> bool:
    return "grammar tables ready" in cluster.log(worker)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0) as made:
        yield made


def chat(client: OpenAI, model: str, prompt: str, response_format: ResponseFormat,
         **sampling: Any) -> tuple[str, str]:
    """The reply's text and finish reason."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        response_format=response_format, **sampling)
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


def all_chats(client: OpenAI, model: str, response_format: ResponseFormat
              ) -> list[tuple[str, str]]:
    """Every prompt under every sampling setting, concurrently (decode batches them)."""
    runs = [(p, s) for p in PROMPTS for s in SAMPLING]
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: chat(client, model, run[0], response_format, **run[1]),
                             runs))


def test_json_schema_output_always_parses_and_validates(
        client: OpenAI, cluster: Cluster) -> None:
    for text, finish in all_chats(client, cluster.model, JSON_SCHEMA_FORMAT):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_is_an_object(client: OpenAI, cluster: Cluster) -> None:
    """Nothing bounds a random model's strings in a free object: what ends must parse."""
    runs = all_chats(client, cluster.model, {"type": "json_object"})
    assert any(finish == "stop" for _, finish in runs)
    for text, finish in runs:
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


def test_streamed_json_schema_output_validates(client: OpenAI, cluster: Cluster) -> None:
    stream = client.chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": "A pet, please"}],
        max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA_FORMAT,
        stream=True, temperature=1.0, seed=3)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_too(client: OpenAI, cluster: Cluster) -> None:
    reply = client.completions.create(
        model=cluster.model, prompt="The pet record:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": JSON_SCHEMA_FORMAT})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)


def test_a_bad_schema_is_a_400_before_any_worker(client: OpenAI, cluster: Cluster) -> None:
    bad: ResponseFormat = {
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "[a"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, cluster.model, "hi", bad)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format"
    assert "invalid JSON schema" in error["message"]


@pytest.mark.parametrize(("fields", "pattern"), [
    ({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
     "positive|negative|neutral"),
    ({"guided_choice": ["yes", "no"]}, "yes|no"),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
    ({"guided_regex": r"(ha){2,5}!"}, r"(ha){2,5}!"),
    ({"structured_outputs": {"grammar": 'root ::= "x = " [1-9] [0-9]? ";"'}}, r"x = [1-9][0-9]?;"),
    ({"guided_grammar": 'root ::= ("a" | "b") ("c" | "d")'}, "[ab][cd]"),
])
def test_vllm_s_structured_outputs_hold_for_every_sampling(
        client: OpenAI, cluster: Cluster, fields: dict[str, Any], pattern: str) -> None:
    """vLLM's `structured_outputs` (and its older `guided_*` fields), through extra_body."""
    for sampling in SAMPLING:
        reply = client.chat.completions.create(
            model=cluster.model, messages=[{"role": "user", "content": "Classify: great!"}],
            max_tokens=40, extra_body=fields, **sampling)
        text = reply.choices[0].message.content or ""
        assert re.fullmatch(pattern, text) and reply.choices[0].finish_reason == "stop", text


def test_a_bad_regex_is_a_400_naming_its_field(client: OpenAI, cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=cluster.model, prompt="hi", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[a-z"}})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "structured_outputs.regex"
    assert "invalid regular expression" in error["message"]
