"""vLLM's routes and extras on the in-process gateway (real tokenizer, no workers):
/tokenize, /detokenize, /version, /ping, served model names and the model card."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.errors import APIError
from gateway.openai_api import stream_resumed_after
from gateway.state import server_version
from tests.gateway.served_app import (
    MAX_MODEL_LEN,
    MODEL,
    error_message_of,
    error_of,
    is_no_worker,
    serve_without_workers,
    valid_body,
)


@pytest.fixture(scope="module")
def client(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir) as client:
        yield client


@pytest.fixture(scope="module")
def named(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir, **{
            "gateway.served_model_name": ["alpha", "beta"]}) as client:
        yield client


def test_tokenize_a_prompt_and_detokenize_it_back(client: TestClient) -> None:
    reply = client.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert reply.json() == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [28120, 905]}
    back = client.post("/detokenize", json={"model": MODEL, "tokens": [28120, 905]})
    assert back.json() == {"prompt": "hello world", "content": "hello world"}  # llama.cpp's too
    strs = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert strs.json()["token_strs"] == ["hello", "Ġworld"]


def test_tokenize_as_llama_cpp_asks(client: TestClient) -> None:
    """llama.cpp's body: `content`; `with_pieces` gives each token's text, or its bytes where
    they are not whole characters."""
    reply = client.post("/tokenize", json={"content": "hello world", "add_special": True})
    assert reply.json()["tokens"] == [28120, 905]
    pieces = client.post("/tokenize", json={"content": "hi 😀", "with_pieces": True}).json()
    shown = pieces["tokens"]
    assert all(set(entry) == {"id", "piece"} for entry in shown)
    assert shown[0]["piece"] == "hi"
    emoji = [entry["piece"] for entry in shown[1:]]
    assert any(isinstance(piece, list) for piece in emoji)  # "😀" over several tokens
    data = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in emoji)
    assert data.decode() == " 😀"


def test_tokenize_messages_under_the_template(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    cued = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    bare = client.post("/tokenize", json={"messages": messages,
                                          "add_generation_prompt": False}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": cued}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert cued[:len(bare)] == bare and len(cued) > len(bare)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "content": "b"}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenize_bodies_are_400(client: TestClient, route: str, body: dict[str, object],
                                     param: str | None) -> None:
    reply = client.post(route, json=body)
    assert reply.status_code == 400
    assert error_of(reply)["param"] == param


def test_tokenize_names_an_unknown_model(client: TestClient) -> None:
    reply = client.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"})
    assert reply.status_code == 404 and error_of(reply)["code"] == "model_not_found"
    for other in ("gpt-4o:latest", f"{MODEL}:v2", f"{MODEL}:"):
        assert client.post("/tokenize", json={"model": other, "prompt": "x"}).status_code == 404


def test_a_served_name_is_taken_with_ollamas_latest_tag_on_every_route(
        client: TestClient) -> None:
    """As /api/tags lists it, and as Ollama's own /v1 routes take it."""
    tagged = client.post("/tokenize", json={"model": f"{MODEL}:latest", "prompt": "x"})
    assert tagged.json()["tokens"] == client.post(
        "/tokenize", json={"model": MODEL, "prompt": "x"}).json()["tokens"]
    body = {**valid_body("/v1/chat/completions"), "model": f"{MODEL}:latest"}
    assert is_no_worker(client.post("/v1/chat/completions", json=body))  # past the name
    assert client.get(f"/v1/models/{MODEL}:latest").json()["id"] == MODEL


def test_a_served_name_with_a_tag_of_its_own_is_itself(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir, **{
            "gateway.served_model_name": ["m", "m:latest"]}) as served:
        assert served.get("/v1/models/m:latest").json()["id"] == "m:latest"
        assert served.get("/v1/models/m").json()["id"] == "m"


def test_version_and_ping(client: TestClient) -> None:
    assert client.get("/version").json() == {"version": server_version()}
    for method in ("GET", "POST"):
        reply = client.request(method, "/ping")
        assert reply.status_code == 503  # no worker yet: as /health says
        assert reply.json() == client.get("/health").json()


def test_the_model_card_shows_the_generation_defaults(client: TestClient) -> None:
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["root"] == MODEL and card["max_model_len"] == MAX_MODEL_LEN
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": 0,
                                           "min_p": 0.0, "repetition_penalty": 1.1,
                                           "max_tokens": 2048}


def test_the_model_list_answers_with_a_trailing_slash_too(named: TestClient) -> None:
    assert named.get("/v1/models/").json() == named.get("/v1/models").json()


@pytest.mark.parametrize(("method", "route", "allowed"), [
    ("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
    ("PUT", "/ping", "GET, POST"),
])
def test_a_wrong_method_is_a_405_that_names_the_right_ones(
        client: TestClient, method: str, route: str, allowed: str) -> None:
    reply = client.request(method, route)
    assert reply.status_code == 405 and error_of(reply)["type"] == "invalid_request_error"
    assert set(reply.headers["allow"].split(", ")) >= set(allowed.split(", "))


def test_every_served_name_is_listed_and_accepted(named: TestClient) -> None:
    assert [card["id"] for card in named.get("/v1/models").json()["data"]] == ["alpha", "beta"]
    assert named.get("/v1/models/beta").json()["root"] == MODEL
    for name in ("alpha", "beta"):
        for route in ("/v1/chat/completions", "/v1/completions"):
            assert is_no_worker(named.post(route, json={**valid_body(route), "model": name}))
    reply = named.post("/v1/completions", json=valid_body("/v1/completions"))  # its own name
    assert reply.status_code == 404
    assert "'alpha', 'beta'" in error_of(reply)["message"]


def test_a_valid_response_request_passes_every_check(client: TestClient) -> None:
    body = {"model": MODEL, "instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}],
        "tools": [{"type": "function", "name": "weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "text": {"format": {"type": "text"}}, "include": ["message.output_text.logprobs"],
        "top_logprobs": 2, "max_output_tokens": 16, "store": True}
    assert is_no_worker(client.post("/v1/responses", json=body))
    streamed = client.post("/v1/responses", json={**body, "stream": True})
    assert is_no_worker(streamed)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].message.content[0]"),
    ({"input": "Hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0]"),
    ({"instructions": "no input"}, "input"),
])
def test_a_response_request_it_cannot_serve_is_a_400(
        client: TestClient, body: dict[str, object], param: str) -> None:
    reply = client.post("/v1/responses", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert error_of(reply)["param"] == param


def test_an_unknown_response_id_is_a_404_wherever_it_is_named(client: TestClient) -> None:
    for reply in (client.get("/v1/responses/resp_none"),
                  client.get("/v1/responses/resp_none?stream=true&starting_after=2"),
                  client.delete("/v1/responses/resp_none"),
                  client.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                     "previous_response_id": "resp_none"})):
        assert reply.status_code == 404, reply.text
        assert error_of(reply)["message"] == "Response with id 'resp_none' not found."


@pytest.mark.parametrize(("query", "after"), [
    ({}, None), ({"stream": "false"}, None), ({"stream": "true"}, -1),
    ({"stream": "True", "starting_after": "7"}, 7), ({"stream": "true", "starting_after": "0"}, 0),
])
def test_a_stream_is_resumed_after_the_sequence_number_asked_for(
        query: dict[str, str], after: int | None) -> None:
    assert stream_resumed_after(query) == after


@pytest.mark.parametrize(("query", "param"), [
    ({"stream": "yes"}, "stream"), ({"starting_after": "3"}, "starting_after"),
    ({"stream": "true", "starting_after": "-1"}, "starting_after"),
    ({"stream": "true", "starting_after": "x"}, "starting_after"),
    ({"stream": "true", "starting_after": "²"}, "starting_after"),  # a digit int() refuses
])
def test_a_resumed_stream_asked_for_wrongly_is_a_400(query: dict[str, str], param: str) -> None:
    with pytest.raises(APIError) as raised:
        stream_resumed_after(query)
    assert raised.value.status == 400 and raised.value.param == param


def test_a_background_response_where_none_are_kept_is_a_400(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir, **{"gateway.stored_responses": 0}) as client:
        reply = client.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                   "background": True})
        assert reply.status_code == 400, reply.text
        assert error_of(reply)["param"] == "background"
        assert "keeps none" in error_of(reply)["message"]
        foreground = client.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
        assert is_no_worker(foreground)  # past every check: only the workers are missing


TEXT_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"prompt": "Hi"},
    "/v1/responses": {"input": "Hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
    "/completion": {"prompt": "Hi"},
    "/api/chat": {"messages": [{"role": "user", "content": "Hi"}]},
    "/api/generate": {"prompt": "Hi"},
}
EMBEDDING_BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"input": "Hi"}, "/api/embed": {"input": "Hi"},
    "/embedding": {"content": "Hi"}}


def test_an_embedding_model_without_an_output_head_embeds_and_refuses_text(
        tiny_qwen3_embedding_dir: Path) -> None:
    """Qwen3-Embedding-8B's checkpoint has no output head: every route that generates is a
    400 in its API's shape, as vLLM's for a pooling model, and Ollama's names what it can."""
    with serve_without_workers(tiny_qwen3_embedding_dir) as embedder:
        for route, body in TEXT_BODIES.items():
            refused = embedder.post(route, json={"model": MODEL, **body})
            assert refused.status_code == 400, (route, refused.text)
            message = error_message_of(refused, route)
            assert "/v1/embeddings" in message or "does not support" in message, message
        for route in ("/api/chat", "/api/generate"):  # Ollama's load: refused first, as there
            refused = embedder.post(route, json={"model": MODEL})
            assert refused.status_code == 400
            assert "does not support" in error_message_of(refused, route)
        for route, body in EMBEDDING_BODIES.items():
            assert is_no_worker(embedder.post(route, json={"model": MODEL, **body}), route)
        shown = embedder.post("/api/show", json={"model": MODEL}).json()
    assert shown["capabilities"] == ["embedding"]


def test_a_suffix_needs_a_model_that_can_fill_in_the_middle(
        client: TestClient, tiny_coder_dir: Path) -> None:
    body = {"model": MODEL, "prompt": "def add(a, b):\n    ", "suffix": "\n", "max_tokens": 4}
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 400 and error_of(refused)["param"] == "suffix"
    assert "fill-in-the-middle" in error_of(refused)["message"]
    # an empty suffix asks for nothing of a model that cannot fill
    assert is_no_worker(client.post("/v1/completions", json={**body, "suffix": ""}))
    with serve_without_workers(tiny_coder_dir) as coder:
        for suffix in ("\n", ""):
            assert is_no_worker(coder.post("/v1/completions", json={**body, "suffix": suffix}))
        tokens = coder.post("/v1/completions", json={**body, "prompt": [1, 2]})
        assert tokens.status_code == 400 and "text prompt" in error_of(tokens)["message"]
