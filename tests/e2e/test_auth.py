"""API keys end to end: a tiny cluster launched with two tenants' keys, one per way of giving
them (flag and keys file), used through the official `openai` client and plain HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.__main__ import main
from tests.e2e.cluster import Cluster, launch

pytestmark = pytest.mark.e2e

ALPHA, BETA = "sk-alpha-e2e-0123456789", "sk-beta-e2e-9876543210"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("run")
    keys_file = run_dir / "keys"
    keys_file.write_text(f"# KEY TENANT\n{BETA} beta\n")
    keys_file.chmod(0o600)
    flags = ["--api-key", f"{ALPHA}:alpha", "--api-key-file", str(keys_file)]
    with launch(run_dir, tiny_model_dir, flags=flags, api_key=ALPHA) as running:
        yield running


def openai_client(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("key", [ALPHA, BETA])
def test_a_right_key_streams_a_completion(cluster: Cluster, key: str) -> None:
    stream = openai_client(cluster, key).completions.create(
        model=cluster.model, prompt="Once upon a time", max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_a_wrong_key_raises_authentication_error(cluster: Cluster) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client(cluster, "sk-not-a-key").chat.completions.create(
            model=cluster.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_no_key_gets_401_json_and_health_stays_open(cluster: Cluster) -> None:
    body = {"model": cluster.model, "prompt": "Hi", "max_tokens": 4}
    response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{cluster.url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{cluster.url}/health", timeout=30).status_code == 200


def test_the_keys_are_in_no_log(cluster: Cluster) -> None:
    assert cluster.client.get("/v1/models").status_code == 200  # the key the cluster sends
    logs = {path.name: path.read_text(errors="replace") for path in cluster.run_dir.glob("*.log")}
    assert "authentication on: 2 API keys for tenants alpha, beta" in logs["gateway.log"]
    assert not [name for name, text in logs.items() if ALPHA in text or BETA in text]


def test_bench_serve_sends_its_api_key(cluster: Cluster, tiny_model_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    argv = ["serve", "--url", cluster.url, "--api-key", BETA, "--tokenizer", str(tiny_model_dir),
            "--input-len", "16", "--output-len", "4", "--num-requests", "2", "--warmup", "0",
            "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["targets"][0]["runs"][0]["summary"]["completed"] == 2
    assert BETA not in out.read_text() and "***" in report["command"]
    assert BETA not in capsys.readouterr().err
