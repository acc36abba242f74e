"""The embedding routes' bodies and what is done to a vector: its bytes read, normalized each
API's way, sent in base64; bodies refused with each API's error, valid ones up to dispatch."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from gateway.embedding_request import (
    EmbeddingRequest,
    LlamaEmbeddingRequest,
    OllamaEmbedRequest,
    base64_of,
    normalized,
    vector_of,
)
from gateway.errors import APIError
from gateway.validation import parse_body
from tests.gateway.served_app import (
    MODEL,
    error_message_of,
    error_of,
    is_no_worker,
    serve_without_workers,
)


def test_a_worker_s_bytes_read_back_and_base64_is_numpy_s_float32() -> None:
    values = np.array([0.5, -1.25, 3.0e-8, 7.0], dtype="<f4")
    vector = vector_of(values.tobytes())
    assert vector.tolist() == values.tolist()
    decoded = np.frombuffer(base64.b64decode(base64_of(vector)), dtype="<f4")
    assert decoded.tolist() == vector.tolist()  # as the openai client decodes it


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x80", np.array([1.0, np.inf], "<f4").tobytes(),
                                  np.array([np.nan], "<f4").tobytes()], ids=repr)
def test_no_vector_or_one_not_finite_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        vector_of(data)


@pytest.mark.parametrize(("norm", "size"), [
    (2, 5.0),  # Euclidean: sqrt(9 + 16)
    (1, 7.0),  # taxicab
    (3, (27 + 64) ** (1 / 3)),
    (0, 4.0 / 32760),  # the largest value scaled to int16's range
])
def test_each_norm_of_llama_cpp_divides_by_its_size(norm: int, size: float) -> None:
    got = normalized(np.array([3.0, -4.0]), norm)
    assert got.tolist() == pytest.approx([3.0 / size, -4.0 / size])


def test_no_norm_and_a_zero_vector_are_left_as_they_are() -> None:
    assert normalized(np.array([3.0, -4.0]), -1).tolist() == [3.0, -4.0]
    assert normalized(np.zeros(2)).tolist() == [0.0, 0.0]


def test_a_high_norm_of_tiny_or_huge_values_neither_underflows_nor_overflows() -> None:
    for scale in (1e-30, 1e30):
        vector = np.array([1.0, -2.0, 0.5]) * scale
        assert math.isclose(float(np.linalg.norm(normalized(vector))), 1.0)
        sixty_four = normalized(vector, 64)
        assert np.all(np.isfinite(sixty_four))
        assert math.isclose(float(np.sum(np.abs(sixty_four) ** 64)), 1.0)


def test_each_input_form_is_a_list_of_inputs() -> None:
    def inputs(value: Any) -> list[str | list[int]] | None:
        return parse_body(EmbeddingRequest, _json({"input": value})).input

    assert inputs("one") == ["one"]
    assert inputs([1, 2, 3]) == [[1, 2, 3]]
    assert inputs(["a", [4, 5]]) == ["a", [4, 5]]
    assert OllamaEmbedRequest(input="one").inputs == ["one"]
    assert LlamaEmbeddingRequest.model_validate({"input": "x"}).inputs == ["x"]
    assert LlamaEmbeddingRequest.model_validate({"content": [[7]]}).inputs == [[7]]


def test_messages_go_under_the_template_without_special_tokens_by_default() -> None:
    chat = parse_body(EmbeddingRequest, _json({"messages": [{"role": "user", "content": "hi"}],
                                                "chat_template_kwargs": {"x": 1}}))
    assert chat.input is None and not chat.special_tokens
    assert not chat.template.add_generation_prompt and chat.template.kwargs == {"x": 1}
    assert parse_body(EmbeddingRequest, _json({"input": "hi"})).special_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({}, ""),
    ({"input": "x", "messages": [{"role": "user", "content": "hi"}]}, ""),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
      "continue_final_message": True}, ""),
    ({"messages": [{"role": "user", "content": "hi"}],
      "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [[1], [-2]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_openai_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as raised:
        parse_body(EmbeddingRequest, _json(body))
    assert raised.value.status == 400 and (raised.value.param or "").startswith(param)


@pytest.fixture(scope="module")
def client(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir) as client:
        yield client


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/embeddings", {"model": MODEL, "input": ["Hi", [1, 2]], "dimensions": 8}),
    ("/v1/embeddings", {"input": "x" * 9000, "truncate_prompt_tokens": -1}),
    ("/api/embed", {"model": f"{MODEL}:latest", "input": "x " * 3000}),  # cut to the context
    ("/api/embed", {"input": ["x"], "dimensions": 100000}),  # all of them, as Ollama's
    ("/api/embed", {"input": ["x"], "dimensions": -1}),  # also all of them
    ("/api/embeddings", {"model": MODEL, "prompt": "Hi"}),
    ("/embedding", {"content": "Hi"}),
    ("/embeddings", {"content": [[1, 2], "Hi"], "embd_normalize": -1}),
])
def test_valid_bodies_reach_dispatch(client: TestClient, route: str,
                                     body: dict[str, Any]) -> None:
    assert is_no_worker(client.post(route, json=body), route)


@pytest.mark.parametrize(("route", "body", "words"), [
    ("/v1/embeddings", {"input": "x " * 3000}, "maximum context length is 2048"),
    ("/v1/embeddings", {"input": ""}, "input 0 is empty"),
    ("/v1/embeddings", {"input": [[70000]]}, "input token ids must be below"),
    ("/v1/embeddings", {"input": "x", "dimensions": 577}, "at most 576"),
    ("/v1/embeddings", {"model": "other", "input": "x"}, "does not exist"),
    ("/api/embed", {"input": "x " * 3000, "truncate": False}, "maximum context length"),
    ("/api/embeddings", {"model": "other", "prompt": "x"}, "does not exist"),
    ("/embedding", {}, "give content"),
    ("/embedding", {"model": "other", "content": "x"}, "does not exist"),
    ("/v1/embeddings", {"input": "x", "priority": 2**64}, "priority"),
    ("/embedding", {"content": "x", "embd_normalize": -2}, "embd_normalize"),
])
def test_bad_bodies_get_each_api_s_400(client: TestClient, route: str, body: dict[str, Any],
                                       words: str) -> None:
    response = client.post(route, json=body)
    assert 400 <= response.status_code < 500
    assert words in error_message_of(response, route)


def test_nothing_to_embed_loads_the_model_as_ollama_does(client: TestClient) -> None:
    embed = client.post("/api/embed", json={"model": MODEL})
    assert embed.status_code == 200
    assert embed.json()["embeddings"] == [] and embed.json()["model"] == MODEL
    nothings: list[object] = ["", None, []]
    for nothing in nothings:
        assert client.post("/api/embed", json={"input": nothing}).json()["embeddings"] == []
    older = client.post("/api/embeddings", json={"model": MODEL, "prompt": ""})
    assert older.json() == {"embedding": []}


def test_strict_fields_refuse_what_the_api_does_not_have(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir, **{"gateway.strict_fields": True}) as strict:
        response = strict.post("/v1/embeddings", json={"input": "x", "pooling": "mean"})
        assert error_of(response)["param"] == "pooling"


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()
