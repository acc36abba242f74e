"""Ollama's routes in-process, with no worker: errors in Ollama's shape (a bad body, a wrong
method or path under /api/, a missing key), the model listings, `:latest` names, and a valid
body reaching dispatch (the replies themselves: tests/e2e/test_ollama_api.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.gateway.served_app import (
    MODEL,
    error_of,
    is_no_worker,
    ollama_error_of,
    serve_without_workers,
)

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(tiny_model_dir) as made:
        yield made


def test_a_valid_body_reaches_dispatch_under_either_name(client: TestClient) -> None:
    for model in (MODEL, f"{MODEL}:latest", None):
        body = {"messages": HI, "model": model} if model else {"messages": HI}
        assert is_no_worker(client.post("/api/chat", json=body), "/api/chat")
    assert is_no_worker(client.post("/api/generate", json={"prompt": "Hi", "raw": True}),
                        "/api/generate")


def test_errors_under_api_are_ollama_s(client: TestClient) -> None:
    bad = client.post("/api/chat", json={"messages": HI, "options": {"top_k": "five"}})
    assert bad.status_code == 400 and "options.top_k" in ollama_error_of(bad)
    missing = client.post("/api/chat", json={"messages": HI, "model": "llama3"})
    assert missing.status_code == 404 and "llama3" in ollama_error_of(missing)
    assert client.get("/api/chat").status_code == 405
    assert ollama_error_of(client.get("/api/chat"))
    assert ollama_error_of(client.post("/api/pull", json={})) == "no route /api/pull"
    assert error_of(client.post("/v1/chat/completions", json={"model": "llama3",
                                                               "messages": HI}))


def test_a_missing_key_is_refused_in_ollama_s_shape(tiny_model_dir: Path) -> None:
    with serve_without_workers(tiny_model_dir, **{"auth.api_keys": ("sk-one",)}) as keyed:
        refused = keyed.get("/api/tags")
        allowed = keyed.get("/api/tags", headers={"Authorization": "Bearer sk-one"})
    assert refused.status_code == 401 and ollama_error_of(refused)
    assert allowed.status_code == 200


def test_the_listings_name_the_model_with_its_tag(client: TestClient) -> None:
    [listed] = client.get("/api/tags").json()["models"]
    assert listed["name"] == listed["model"] == f"{MODEL}:latest"
    assert listed["details"]["family"] == "llama" and len(listed["digest"]) == 64
    shown = client.post("/api/show", json={"name": listed["name"]}).json()
    assert shown["model_info"]["llama.context_length"] == 2048  # served_app's context
    assert shown["model_info"]["llama.block_count"] == 2
    assert shown["details"] == listed["details"] and "temperature" in shown["parameters"]
    assert client.post("/api/show", json={}).status_code == 400
    assert client.post("/api/show", json={"model": "llama3"}).status_code == 404
    assert client.get("/api/ps").json() == {"models": []}  # no decode worker serves it
    version = client.get("/api/version").json()
    assert version["version"] == "0.12.0" and version["raging"]


def test_tools_and_thinking_need_their_parsers(client: TestClient, tiny_model_dir: Path
                                               ) -> None:
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    refused = client.post("/api/chat", json={"messages": HI, "tools": [tool]})
    assert refused.status_code == 400 and "does not support tools" in ollama_error_of(refused)
    thinking = client.post("/api/chat", json={"messages": HI, "think": True})
    assert thinking.status_code == 400 and "does not support thinking" in (
        ollama_error_of(thinking))
    with serve_without_workers(tiny_model_dir, **{"gateway.tool_call_parser": "hermes",
                                                  "gateway.reasoning_parser": "qwen3"}) as able:
        body = {"messages": HI, "tools": [tool], "think": True}
        assert is_no_worker(able.post("/api/chat", json=body), "/api/chat")
        capabilities = able.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    assert capabilities == ["completion", "tools", "thinking"]


def test_a_suffix_needs_a_model_that_can_fill_in_the_middle(
        client: TestClient, tiny_coder_dir: Path) -> None:
    body = {"prompt": "def add(a, b):\n    ", "suffix": "\n"}
    refused = client.post("/api/generate", json=body)
    assert refused.status_code == 400
    assert ollama_error_of(refused) == f"'{MODEL}:latest' does not support insert"
    assert "insert" not in client.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    with serve_without_workers(tiny_coder_dir) as coder:
        assert is_no_worker(coder.post("/api/generate", json=body), "/api/generate")
        capabilities = coder.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    assert capabilities == ["completion", "insert"]
