"""Anthropic's routes on the real gateway app with no worker: token counts, and every error in
Anthropic's shape (the replies themselves: tests/e2e/test_messages.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.gateway.served_app import (
    MODEL,
    NO_WORKER,
    anthropic_error_of,
    error_of,
    serve_without_workers,
)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir, **{"gateway.max_body_bytes": 100_000}) as made:
        yield made


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "messages": MESSAGES, **fields}


def test_tokens_are_counted_as_the_chat_template_renders_them(client: TestClient) -> None:
    counted = client.post("/v1/messages/count_tokens",
                          json={"model": MODEL, "system": "Be brief.", "messages": MESSAGES})
    assert counted.status_code == 200, counted.text
    chat = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    tokenized = client.post("/tokenize", json={"model": MODEL, "messages": chat}).json()
    assert counted.json() == {"input_tokens": tokenized["count"]}


@pytest.mark.parametrize(("request_body", "status", "kind", "words"), [
    (b"{", 400, "invalid_request_error", "JSON"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
     "invalid_request_error", "image input is not supported"),
    (body(model="claude-nope"), 404, "not_found_error", "claude-nope"),
    (body(system="word " * 3000), 400, "invalid_request_error", "your prompt is"),
    (body(), 503, "overloaded_error", NO_WORKER),
    (body(max_tokens=10**6), 503, "overloaded_error", NO_WORKER),  # past the context: allowed
    (body(system="x" * 200_000), 413, "request_too_large", "exceeds"),
])
def test_errors_take_anthropic_s_shape(client: TestClient, request_body: dict[str, Any] | bytes,
                                       status: int, kind: str, words: str) -> None:
    if isinstance(request_body, bytes):
        response = client.post("/v1/messages", content=request_body)
    else:
        response = client.post("/v1/messages", json=request_body)
    assert response.status_code == status, response.text
    error = anthropic_error_of(response)
    assert error["type"] == kind and words in error["message"]


def test_a_wrong_method_or_path_under_messages_is_anthropic_shaped(client: TestClient) -> None:
    assert anthropic_error_of(client.get("/v1/messages"))["type"] == "invalid_request_error"
    assert anthropic_error_of(client.post("/v1/messages/nope", json={}))["type"] == (
        "not_found_error")
    assert error_of(client.post("/v1/chat/completions", content=b"{"))["type"] == (
        "invalid_request_error")  # OpenAI's routes keep OpenAI's shape


def test_a_missing_or_wrong_key_is_an_authentication_error(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir, **{"auth.api_keys": ("sk-one",)}) as client:
        missing = client.post("/v1/messages", json=body())
        wrong = client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-two"})
        right = client.post("/v1/messages/count_tokens", json=body(),
                            headers={"x-api-key": "sk-one", "anthropic-version": "2023-06-01"})
    for refused in (missing, wrong):
        assert refused.status_code == 401
        assert anthropic_error_of(refused)["type"] == "authentication_error"
    assert right.status_code == 200 and right.json()["input_tokens"] > 0
