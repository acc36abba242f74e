"""`--log-format json` end to end: every line every process writes is one JSON object, and a
request's id is on lines of the gateway and of both workers (prefill and decode)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.cluster import Cluster, launch

pytestmark = pytest.mark.e2e

PROCESSES = ("gateway", "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir,
                flags=["--log-format", "json"]) as running:
        yield running


def lines_of(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    lines = []
    for text in cluster.log(name).splitlines():
        line = json.loads(text)  # every line, or the test fails here
        assert isinstance(line, dict) and {"time", "level", "logger", "process",
                                           "message"} <= line.keys(), text
        lines.append(line)
    return lines


def test_every_line_is_json_and_names_the_request_everywhere(cluster: Cluster) -> None:
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=cluster.model, messages=[{"role": "user", "content": "Hello there, friend"}],
            max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    cluster.client.get("/v1/no-such-route")  # and a line from the HTTP server's side, if any
    request_ids: dict[str, set[str]] = {}
    for name in PROCESSES:
        lines = lines_of(cluster, name)
        assert lines and {line["process"] for line in lines} == {name}
        request_ids[name] = {line["request_id"] for line in lines if "request_id" in line}
        assert all(isinstance(line.get("epoch", 0), int) for line in lines)
    # The gateway's own id for the request (the reply's id is the API's) is on every process.
    common = request_ids["gateway"] & request_ids["prefill-0"] & request_ids["decode-0"]
    assert len(common) == 1, request_ids
