"""The gateway's fuzz strategies (tests/gateway/test_fuzz.py) against a whole running cluster:
bodies that pass validation are served for real, so every reply must be a 2xx with a complete
answer (llama.cpp's shape on /completion, Ollama's on /api/chat and /api/generate, each API's
list of vectors on the embedding routes) or a 4xx
with error JSON in the route's shape (OpenAI's, Anthropic's on /v1/messages, Ollama's on its
routes); never a 5xx, and the cluster serves on afterwards.

`--cluster-fuzz-examples N` sets the examples per strategy (a few hundred in CI).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.e2e.cluster import TEST_CONFIG, Cluster, launch
from tests.gateway.served_app import MODEL, error_message_of
from tests.gateway.test_fuzz import (
    MESSAGES,
    NATIVE,
    OLLAMA,
    Body,
    byte_bodies,
    json_bodies,
    mutated_bodies,
    schema_bodies,
)

pytestmark = pytest.mark.e2e

FINISH_REASONS = ("stop", "length", "tool_calls", "function_call")  # OpenAI's
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use",  # Anthropic's
                "model_context_window_exceeded")
STRATEGIES = {"schema": schema_bodies(), "json": json_bodies(), "bytes": byte_bodies(),
              "mutated": mutated_bodies()}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A short context keeps every completion the fuzz asks for short, and a body that asks
    # for no length gets 16 tokens (the 2,048 shipped took most bodies to the context's end,
    # 94 % of the tokens the fuzz generated); a request stuck for 30 s ends in an error event
    # (which fails the test) rather than hanging it.
    gateway = {**TEST_CONFIG["gateway"], "progress_timeout_s": 30.0}
    defaults = {**TEST_CONFIG["generation_defaults"], "max_tokens": 16}
    config = {**TEST_CONFIG, "gateway": gateway, "model": {"max_model_len": 256},
              "generation_defaults": defaults}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config) as running:
        yield running


def check_served(cluster: Cluster, route: str, body: bytes) -> int:
    """Post one body (naming the cluster's model where it names one): a complete answer or a
    4xx OpenAI error. Returns the status code."""
    body = body.replace(json.dumps(MODEL).encode(), json.dumps(cluster.model).encode())
    headers = {"content-type": "application/json"}
    with cluster.client.stream("POST", route, content=body, headers=headers) as response:
        raw = response.read()
    anthropic = route == MESSAGES
    if response.status_code != 200:
        assert 400 <= response.status_code < 500, raw[:500]
        error_message_of(httpx.Response(response.status_code, content=raw), route)
    elif route == NATIVE:
        check_native(raw, response.headers["content-type"])
    elif route in OLLAMA:
        check_ollama(raw)
    elif route in VECTORS_AT:
        check_vectors(VECTORS_AT[route](json.loads(raw)))
    elif response.headers["content-type"].startswith("text/event-stream"):
        kind = "event: " if anthropic else "data: "
        events = [line for line in raw.decode().splitlines() if line.startswith(kind)]
        assert events[-1] == ("event: message_stop" if anthropic else "data: [DONE]"), \
            events[-3:]
    elif anthropic:
        assert json.loads(raw)["stop_reason"] in STOP_REASONS, raw[:500]
    else:
        assert json.loads(raw)["choices"][0]["finish_reason"] in FINISH_REASONS, raw[:500]
    return response.status_code


def check_native(raw: bytes, content_type: str) -> None:
    """llama.cpp's /completion: one object (an array, for several prompts), or a stream of
    them, where each prompt's last says `stop: true` and what stopped it."""
    if content_type.startswith("text/event-stream"):
        lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        pieces = [json.loads(line.removeprefix("data: ")) for line in lines]
        ends = [piece for piece in pieces if piece["stop"]]
        assert len(ends) == 1 + max(piece["index"] for piece in pieces), raw[-500:]
    else:
        whole = json.loads(raw)
        ends = whole if isinstance(whole, list) else [whole]
    for end in ends:
        assert end["stop"] is True and end["stop_type"] in ("limit", "word", "eos"), raw[-500:]


# Where each embedding route's reply holds its vectors.
VECTORS_AT: dict[str, Callable[[Any], list[Any]]] = {
    "/v1/embeddings": lambda reply: [item["embedding"] for item in reply["data"]],
    "/embedding": lambda reply: [vector for item in reply for vector in item["embedding"]],
    "/api/embed": lambda reply: reply["embeddings"],
    "/api/embeddings": lambda reply: [reply["embedding"]] if reply["embedding"] else [],
}


def check_vectors(vectors: list[Any]) -> None:
    """Each vector a list of finite numbers (or OpenAI's base64 of them)."""
    for vector in vectors:
        if isinstance(vector, str):
            data = base64.b64decode(vector)
            vector = list(struct.unpack(f"<{len(data) // 4}f", data))
        assert vector and all(isinstance(x, float) and math.isfinite(x) for x in vector)


def check_ollama(raw: bytes) -> None:
    """Ollama's /api/chat and /api/generate: one object, or a line of JSON per object, the
    last `done` and saying why (a body with nothing to generate 'loads' the model)."""
    *pieces, last = [json.loads(line) for line in raw.decode().splitlines() if line]
    assert not any(piece["done"] or "error" in piece for piece in pieces), raw[-500:]
    assert last["done"] is True, raw[-500:]
    assert last["done_reason"] in ("stop", "length", "load", "unload"), raw[-500:]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fuzz_against_a_running_cluster(cluster: Cluster, strategy: str,
                                        cluster_fuzz_examples: int) -> None:
    statuses: Counter[int] = Counter()

    @settings(max_examples=cluster_fuzz_examples, deadline=None, derandomize=True,
              database=None, suppress_health_check=[HealthCheck.too_slow,
                                                    HealthCheck.data_too_large])
    @given(STRATEGIES[strategy])
    def run(body: Body) -> None:
        statuses[check_served(cluster, *body)] += 1

    run()
    print(f"{strategy}: {sum(statuses.values())} bodies, replies by status: "
          f"{dict(sorted(statuses.items()))}")
    if strategy == "schema":
        assert statuses[200] >= sum(statuses.values()) // 3  # most are served for real
    assert cluster.client.get("/health").status_code == 200
