"""The real gateway app, in-process, with a real (empty) registry: for tests of what it accepts.

Nothing under test is faked: the app runs its lifespan (a real Dispatcher on an in-process zmq
address), the tokenizer is the real one, and since no worker ever registers, a request that
passes every check ends in the dispatcher's 503 "no worker available".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from starlette.testclient import TestClient
from transformers import AutoTokenizer

from core.config import load_config
from engine.weights.spec import load_spec
from gateway.app import build_app
from gateway.errors import MAX_MESSAGE_CHARS, dialect_of
from gateway.metrics import Metrics
from gateway.model_facts import model_facts
from gateway.registry import Registry
from gateway.routing import Router
from gateway.state import GatewayState

MODEL = "tiny"
MAX_MODEL_LEN = 2048
ROUTES = ("/v1/chat/completions", "/v1/completions")
NO_WORKER = "no decode worker is available"
ERROR_FIELDS = {"message", "type", "param", "code"}


@contextmanager
def serve_without_workers(tokenizer_dir: Path, **overrides: object) -> Iterator[TestClient]:
    """A client of the gateway app with its lifespan running and no worker registered;
    `overrides` are config settings, as `{"gateway.strict_fields": True}`."""
    control = f"inproc://gateway-validation-{uuid.uuid4().hex}"
    config = load_config(overrides={"gateway.control_address": control, **overrides})
    registry = Registry("fingerprint", 2.5, 1, 1)
    state = GatewayState(
        config=config, model_name=MODEL, max_model_len=MAX_MODEL_LEN,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        registry=registry, router=Router(registry), metrics=Metrics(),
        facts=model_facts(tokenizer_dir, load_spec(tokenizer_dir), "float32"),
    )  # fmt: skip
    with TestClient(build_app(state), raise_server_exceptions=False) as client:
        yield client


def valid_body(route: str, **fields: Any) -> dict[str, Any]:
    """A request to `route` that passes validation (then finds no worker)."""
    if route == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


class Reply(Protocol):
    """An HTTP response as httpx (or the test client's httpx2) gives it."""

    @property
    def status_code(self) -> int: ...

    def json(self) -> Any: ...


def error_of(response: Reply) -> dict[str, Any]:
    """The OpenAI error object of a non-2xx reply, checked for shape; fails on anything else."""
    body = response.json()
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str), error
    assert 0 < len(error["message"]) <= MAX_MESSAGE_CHARS, error
    assert isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def anthropic_error_of(response: Reply) -> dict[str, Any]:
    """The Anthropic error object of a non-2xx reply (Anthropic's routes), checked for shape."""
    body = response.json()
    assert isinstance(body, dict), body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert set(error) == {"type", "message"}, error
    assert isinstance(error["type"], str), error
    assert isinstance(error["message"], str), error
    assert 0 < len(error["message"]) <= MAX_MESSAGE_CHARS, error
    return error


def ollama_error_of(response: Reply) -> str:
    """The message of an Ollama error reply (Ollama's routes), checked for shape."""
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    message = body["error"]
    assert isinstance(message, str) and 0 < len(message) <= MAX_MESSAGE_CHARS, body
    return message


def error_message_of(response: Reply, route: str) -> str:
    """The message of an error reply to `route`, checked for the shape of the route's API."""
    dialect = dialect_of(route)
    if dialect == "anthropic":
        return str(anthropic_error_of(response)["message"])
    if dialect == "ollama":
        return ollama_error_of(response)
    return str(error_of(response)["message"])


def is_no_worker(response: Reply, route: str = "") -> bool:
    """Whether this is the documented 503 for a request to `route` that passed every check."""
    return response.status_code == 503 and error_message_of(response, route) == NO_WORKER


def assert_still_serving(client: TestClient, route: str) -> None:
    """A valid request is still accepted up to dispatch."""
    response = client.post(route, json=valid_body(route))
    assert is_no_worker(response), response.text
