"""API keys: the middleware in front of the app, the key table, key files and the start-up log."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from starlette.types import Message

from core.config import AuthConfig, Config, load_config
from core.messages import GenerationTask
from gateway import auth
from gateway.app import build_app
from gateway.auth import KeysError, Tenant, load_keys
from gateway.background import EventLog
from gateway.errors import service_unavailable
from gateway.metrics import Metrics
from gateway.registry import Registry
from gateway.response_store import StoredResponse
from gateway.routing import Router
from gateway.state import GatewayState

MODEL = "tiny"
ALPHA, BETA, BETA_TOO = "sk-alpha-0123456789", "sk-beta-9876543210", "sk-beta-second-key"
KEYS = (f"{ALPHA}:alpha", f"{BETA}:beta", f"{BETA_TOO}:beta")
BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}


class FakeTokenizer:
    def __len__(self) -> int:
        return 1000

    def get_vocab(self) -> dict[str, int]:  # no fill-in-the-middle markers
        return {}


class RecordingDispatcher:
    """Keeps every task it is given, then refuses it: no workers are needed to see the salt."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.tasks: list[GenerationTask] = []
        self.control = SimpleNamespace(dropped=0)
        self.aborts_sent = self.resumed = 0

    async def until_decode_serves(self) -> None:
        pass

    def submit_choices(self, task: GenerationTask, n: int, arrived: float | None = None,
                       traceparent: str = "") -> None:
        self.tasks.append(task)
        raise service_unavailable("recorded")


def make_state(keys: tuple[str, ...] = KEYS, host: str = "127.0.0.1") -> GatewayState:
    config = load_config(overrides={"gateway.host": host})
    config = dataclasses.replace(config, auth=AuthConfig(api_keys=keys))
    registry = Registry("fp", 2.5, 1, 1)
    state = GatewayState(config=config, model_name=MODEL, max_model_len=64,
                         tokenizer=FakeTokenizer(),  # type: ignore[arg-type]  # len(), vocab
                         registry=registry, router=Router(registry), metrics=Metrics())
    state.dispatcher = RecordingDispatcher()  # type: ignore[assignment]
    return state


@pytest.fixture
def state() -> GatewayState:
    return make_state()


@pytest.fixture
def client(state: GatewayState) -> TestClient:
    # No `with`: the lifespan (the zmq control plane) is not needed in front of a fake dispatcher.
    return TestClient(build_app(state), raise_server_exceptions=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_refused(response: Any, message: str) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}}


def test_a_request_without_a_key_is_refused(client: TestClient, state: GatewayState) -> None:
    response = client.post("/v1/completions", json=BODY)
    assert_refused(response, response.json()["error"]["message"])
    assert "didn't provide an API key" in response.json()["error"]["message"]
    assert state.dispatcher.tasks == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("headers", [
    bearer("sk-wrong"), bearer(ALPHA + "x"), bearer(ALPHA[:-1]), {"x-api-key": "sk-wrong"},
])
def test_a_wrong_key_is_refused_without_echoing_it(client: TestClient,
                                                   headers: dict[str, str]) -> None:
    response = client.post("/v1/completions", json=BODY, headers=headers)
    assert_refused(response, "Incorrect API key provided.")
    assert "sk-" not in response.text


@pytest.mark.parametrize("headers", [{"Authorization": f"Basic {ALPHA}"},
                                     {"Authorization": "Bearer "}, {"x-api-key": ""}])
def test_a_key_in_no_accepted_form_counts_as_missing(client: TestClient,
                                                     headers: dict[str, str]) -> None:
    response = client.get("/v1/models", headers=headers)
    assert response.status_code == 401 and "didn't provide" in response.text


def salt_of(client: TestClient, state: GatewayState, headers: dict[str, str]) -> str:
    response = client.post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == 503  # the recording dispatcher's refusal: auth let it in
    return state.dispatcher.tasks[-1].cache_salt  # type: ignore[attr-defined]


def test_each_tenant_gets_its_own_salt_from_its_key(client: TestClient,
                                                    state: GatewayState) -> None:
    alpha = salt_of(client, state, bearer(ALPHA))
    beta = salt_of(client, state, {"authorization": f"bearer {BETA}"})
    assert alpha != beta and "" not in (alpha, beta)
    assert alpha == Tenant.named("alpha").cache_salt and "alpha" not in alpha
    assert salt_of(client, state, {"x-api-key": BETA_TOO}) == beta  # same tenant, other key


def test_the_body_cannot_choose_the_tenant(client: TestClient, state: GatewayState) -> None:
    body = {**BODY, "user": "beta"}
    assert salt_of_body(client, state, body) == Tenant.named("alpha").cache_salt
    # vLLM's field: unknown here, so ignored; the salt is still the key's tenant's.
    forged = {**BODY, "cache_salt": "forged"}
    assert salt_of_body(client, state, forged) == Tenant.named("alpha").cache_salt


def salt_of_body(client: TestClient, state: GatewayState, body: dict[str, Any]) -> str:
    client.post("/v1/completions", json=body, headers=bearer(ALPHA))
    return state.dispatcher.tasks[-1].cache_salt  # type: ignore[attr-defined]


def test_health_is_open(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 503 and "status" in response.json()  # no workers yet


@pytest.mark.parametrize("path", ["/metrics", "/v1/models", "/v1/models/tiny",
                                  "/v1/chat/completions", "/no/such/route"])
def test_every_other_route_needs_a_key(client: TestClient, path: str) -> None:
    assert client.get(path).status_code == 401
    assert client.get(path, headers=bearer(BETA)).status_code != 401


def test_the_models_list_with_a_key(client: TestClient) -> None:
    response = client.get("/v1/models", headers=bearer(ALPHA))
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL


def test_without_keys_auth_is_off_and_the_salt_empty() -> None:
    state = make_state(keys=())
    client = TestClient(build_app(state))
    assert client.get("/v1/models").status_code == 200
    assert salt_of(client, state, {}) == ""


def test_keys_never_reach_the_logs(state: GatewayState, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client = TestClient(build_app(state), raise_server_exceptions=False)
    for headers in (bearer(ALPHA), bearer("sk-wrong-guess"), {"x-api-key": BETA}, {}):
        client.post("/v1/completions", json=BODY, headers=headers)
    assert "authentication on: 3 API keys for tenants alpha, beta" in caplog.text
    assert "refused /v1/completions" in caplog.text
    for secret in (ALPHA, BETA, BETA_TOO, "sk-wrong-guess"):
        assert secret not in caplog.text
    assert ALPHA not in repr(state.config)


def test_the_body_is_not_read_without_a_key(state: GatewayState) -> None:
    app = build_app(state)
    assert_no_body_read(app, [(b"content-length", b"1000000")])
    assert_no_body_read(app, [(b"authorization", b"Bearer sk-wrong")])


def assert_no_body_read(app: Starlette, headers: list[tuple[bytes, bytes]]) -> None:
    received: list[str] = []
    sent: list[Message] = []

    async def receive() -> Message:
        received.append("called")
        return {"type": "http.request", "body": b"{}", "more_body": True}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert received == [] and sent[0]["status"] == 401


def test_every_entry_is_compared_whichever_key_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    table = load_keys(AuthConfig(api_keys=KEYS))
    calls: list[int] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented, tenant in ((ALPHA, "alpha"), (BETA_TOO, "beta"), ("sk-nobody", None)):
        calls.clear()
        found = table.lookup(presented)
        assert (found.name if found else None) == tenant and len(calls) == len(KEYS)


def test_a_spec_without_a_tenant_is_the_default_tenant() -> None:
    table = load_keys(AuthConfig(api_keys=("sk-one", "sk-two:")))
    tenant = table.lookup("sk-one")
    assert tenant is not None and tenant.name == auth.DEFAULT_TENANT
    assert table.lookup("sk-two") == tenant and table.lookup("sk-one:") is None


def write_keys(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_keys_file_adds_to_the_configured_keys(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = write_keys(tmp_path, "# KEY TENANT\n\n  sk-file-one  team.one \nsk-file-two\n")
    table = load_keys(AuthConfig(api_keys=KEYS, keys_file=str(path)))
    assert len(table.entries) == 5 and "accessible to other users" not in caplog.text
    assert table.lookup("sk-file-one") == Tenant.named("team.one")
    assert table.lookup("sk-file-two") == Tenant.named(auth.DEFAULT_TENANT)


def test_a_keys_file_others_can_read_is_warned_about(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    load_keys(AuthConfig(keys_file=str(write_keys(tmp_path, "sk-a a\n", 0o644))))
    assert "accessible to other users" in caplog.text


@pytest.mark.parametrize(("text", "where"), [
    ("sk-secret-a a\nsk-secret-b b extra\n", "keys:2: expected KEY [TENANT]"),
    ("sk-secret-a bad/tenant\n", "keys:1: a tenant name"),
    ("sk-secret-a a\nsk-secret-a b\n", "keys:2: the same key is already given at"),
    ("sk-secret:a a\n", "keys:1: a key must be printable ASCII"),
])
def test_a_bad_keys_file_names_the_line_not_the_key(tmp_path: Path, text: str,
                                                    where: str) -> None:
    with pytest.raises(KeysError, match=re.escape(where)) as caught:
        load_keys(AuthConfig(keys_file=str(write_keys(tmp_path, text))))
    assert "secret" not in str(caught.value).replace(str(tmp_path), "")


def test_a_missing_keys_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="cannot read the keys file"):
        load_keys(AuthConfig(keys_file=str(tmp_path / "absent")))


@pytest.mark.parametrize("spec", ["", ":tenant", "sk bad", "sk-\u00e9", "sk-a:b:c",
                                  "sk-a:" + "t" * 65])
def test_a_bad_key_spec_is_refused(spec: str) -> None:
    with pytest.raises(KeysError, match=r"auth.api_keys\[1\]"):
        load_keys(AuthConfig(api_keys=("sk-fine", spec)))


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(KeysError, match=r"api_keys\[1\]: the same key .* auth.api_keys\[0\]"):
        load_keys(AuthConfig(api_keys=("sk-a:one", "sk-a:two")))


def test_bad_keys_stop_the_app_from_being_built() -> None:
    with pytest.raises(KeysError):
        build_app(make_state(keys=("sk bad",)))


def test_command_line_keys_add_to_the_config() -> None:
    config = dataclasses.replace(Config(), auth=AuthConfig(api_keys=("sk-a:one",)))
    assert auth.with_keys(config, ["sk-b:two"]).auth.api_keys == ("sk-a:one", "sk-b:two")
    assert auth.with_keys(config, []) == config


@pytest.mark.parametrize(("host", "keys", "warned"), [
    ("0.0.0.0", (), True), ("127.0.0.1", (), False), ("0.0.0.0", KEYS, False),
])
def test_an_exposed_gateway_without_keys_warns_at_start(
    host: str, keys: tuple[str, ...], warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    build_app(make_state(keys=keys, host=host))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) is warned
    assert not warned or "without API keys" in warnings[0].getMessage()


def test_a_kept_response_is_its_tenants_alone(client: TestClient, state: GatewayState) -> None:
    alpha_salt = salt_of(client, state, bearer(ALPHA))
    item = {"id": "msg_a", "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": "Hi"}]}
    state.responses.keep(StoredResponse(alpha_salt, {"id": "resp_a", "object": "response",
                                                     "background": True},
                                        [{"role": "user", "content": "Hi"}], [item]))
    log = EventLog()
    log.append('event: response.created\ndata: {"sequence_number": 0}\n\n')
    log.end()
    state.background.add_log(alpha_salt, "resp_a", log)  # as a background stream leaves it
    continued = {"model": MODEL, "input": "Again", "previous_response_id": "resp_a"}
    for key in (BETA, BETA_TOO):
        assert client.get("/v1/responses/resp_a", headers=bearer(key)).status_code == 404
        assert client.get("/v1/responses/resp_a?stream=true",
                          headers=bearer(key)).status_code == 404
        assert client.post("/v1/responses", json=continued,
                           headers=bearer(key)).status_code == 404
        assert client.get("/v1/responses/resp_a/input_items",
                          headers=bearer(key)).status_code == 404
        assert client.post("/v1/responses/resp_a/cancel", headers=bearer(key)).status_code == 404
        assert client.delete("/v1/responses/resp_a", headers=bearer(key)).status_code == 404
    assert client.get("/v1/responses/resp_a/input_items",
                      headers=bearer(ALPHA)).json()["data"] == [item]
    assert client.post("/v1/responses/resp_a/cancel", headers=bearer(ALPHA)).json()["id"] == \
        "resp_a"  # it has ended: returned as it is
    assert client.get("/v1/responses/resp_a", headers=bearer(ALPHA)).json()["id"] == "resp_a"
    assert client.get("/v1/responses/resp_a?stream=true", headers=bearer(ALPHA)).text == \
        log.events[0]
    assert client.delete("/v1/responses/resp_a", headers=bearer(ALPHA)).json()["deleted"]
    assert state.background.log(alpha_salt, "resp_a") is None  # forgotten with it
    assert client.get("/v1/responses/resp_a", headers=bearer(ALPHA)).status_code == 404
