"""`GET /v1/cluster`: the gateway's view of its workers, requests, latency and membership as
JSON, served by the real app (lifespan and dispatcher running) over a real registry."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient
from transformers import AutoTokenizer

from core.config import Role, load_config
from core.messages import Heartbeat, Register
from gateway.app import build_app
from gateway.metrics import Metrics
from gateway.registry import Registry
from gateway.routing import Router
from gateway.state import GatewayState
from tests.gateway.served_app import error_of

FP = "tiny|float32|layers=2|kv_heads=2|head_dim=16"
KEY = "sk-cluster-test-0123"
WORKERS: tuple[tuple[str, Role, str], ...] = (
    ("decode-1", "decode", "host-b"), ("prefill-0", "prefill", "host-a"),
    ("decode-0", "decode", "host-a"))


def join(registry: Registry, worker_id: str, role: Role, host: str = "", blocks: int = 100) -> None:
    address = "tcp://127.0.0.1:9" if role == "decode" else ""
    reply, _ = registry.register(Register(worker_id, "i0", role, address, FP, 16, blocks, host))
    assert reply.accepted, reply.reason


@contextmanager
def served(tokenizer_dir: Path, keys: tuple[str, ...] = ()) -> Iterator[tuple[TestClient,
                                                                             GatewayState]]:
    overrides: dict[str, object] = {
        "gateway.control_address": f"inproc://cluster-test-{uuid.uuid4().hex}",
        "auth.api_keys": list(keys)}
    registry = Registry(FP, 30.0, 1, 2)
    state = GatewayState(
        config=load_config(overrides=overrides), model_name="tiny", max_model_len=2048,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        registry=registry, router=Router(registry), metrics=Metrics())
    with TestClient(build_app(state), raise_server_exceptions=False) as client:
        yield client, state


def cluster(client: TestClient, **headers: str) -> dict[str, Any]:
    response = client.get("/v1/cluster", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    body = response.json()
    assert isinstance(body, dict) and body["object"] == "cluster"
    return body


def test_every_worker_is_listed_with_role_host_and_load(real_model_dir: Path) -> None:
    with served(real_model_dir) as (client, state):
        for worker_id, role, host in WORKERS:
            join(state.registry, worker_id, role, host)
        assert state.registry.heartbeat(Heartbeat("decode-0", "i0", queued_tokens=7,
                                                  free_blocks=60, running=3, waiting=2))
        body = cluster(client)
    workers = {w["id"]: w for w in body["workers"]}
    assert [w["id"] for w in body["workers"]] == ["prefill-0", "decode-0", "decode-1"]
    assert {(i, w["role"], w["host"]) for i, w in workers.items()} == set(WORKERS)
    beating = workers["decode-0"]
    assert (beating["kv_blocks_used"], beating["kv_blocks_total"]) == (40, 100)
    assert (beating["running"], beating["waiting"], beating["queued_tokens"]) == (3, 2, 7)
    assert beating["state"] == "serving" and beating["stalled"] is False
    silent = workers["decode-1"]
    assert silent["state"] == "joining" and silent["kv_blocks_used"] is None
    assert silent["running"] is None and silent["kv_blocks_total"] == 100
    assert body["status"] == "ok" and body["expected"] == {"prefill": 1, "decode": 2}


def test_events_record_joins_stalls_and_leaves_in_order(real_model_dir: Path) -> None:
    with served(real_model_dir) as (client, state):
        registry = state.registry
        join(registry, "prefill-0", "prefill", "host-a")
        join(registry, "decode-0", "decode", "host-a")
        refused = Register("decode-9", "i0", "decode", "", "other-layout", 16, 100, "host-z")
        assert not registry.register(refused)[0].accepted
        registry.workers["decode-0"].stalled = True  # as Registry.newly_stalled marks one
        registry.remove("prefill-0")
        body = cluster(client)
    kinds = [(e["kind"], e["worker_id"]) for e in body["events"]]
    assert kinds == [("registered", "prefill-0"), ("registered", "decode-0"),
                     ("refused", "decode-9"), ("left", "prefill-0")]
    assert body["events"][0]["host"] == "host-a" and body["events"][0]["role"] == "prefill"
    assert "KV layout mismatch" in body["events"][2]["detail"]
    assert body["refused_registrations"] == 1
    assert [w["id"] for w in body["workers"]] == ["decode-0"]
    assert body["workers"][0]["state"] == "stalled"
    assert body["status"] == "starting"  # the second expected decode worker never came


def test_decisions_count_every_route_taken_by_path(real_model_dir: Path) -> None:
    with served(real_model_dir) as (client, state):
        join(state.registry, "decode-0", "decode")
        for _ in range(3):
            assert state.router.route([1, 2, 3]) is not None
        join(state.registry, "prefill-0", "prefill")
        route = state.router.route(list(range(40)))
        assert route is not None and route.path == "disaggregated"
        scored = state.router.route(list(range(40)), prompt_logprobs=True)
        assert scored is not None and scored.path == "local_prompt_logprobs"
        assert scored.prefill is scored.decode and scored.pull is None
        body = cluster(client)
    assert body["decisions"] == {"disaggregated": 1, "local_short": 0, "local_saturated": 0,
                                 "local_no_prefill": 3, "local_cached": 0,
                                 "local_prompt_logprobs": 1}


def test_recent_latency_comes_from_the_gateway_metrics(real_model_dir: Path) -> None:
    with served(real_model_dir) as (client, state):
        empty = cluster(client)["latency"]
        state.metrics.recent.ttft(0.25)
        state.metrics.recent.ttft(0.75)
        state.metrics.recent.tpot(0.05)
        latency = cluster(client)["latency"]
    assert empty["ttft"] == {"count": 0, "mean_ms": None, "max_ms": None}
    assert empty["buckets"] == []
    assert (latency["bucket_s"], latency["window_s"]) == (10.0, 300.0)
    assert latency["ttft"] == {"count": 2, "mean_ms": 500.0, "max_ms": 750.0}
    assert latency["tpot"] == {"count": 1, "mean_ms": 50.0, "max_ms": 50.0}
    assert len(latency["buckets"]) in (1, 2)  # two when the samples straddle a bucket edge


def test_requests_in_flight_are_counted(real_model_dir: Path) -> None:
    with served(real_model_dir) as (client, _):
        body = cluster(client)
    assert body["requests"] == {"in_flight": 0, "awaiting_first_token": 0,
                                "queued_prompt_tokens": 0}
    assert body["model"] == "tiny"


def test_with_keys_the_cluster_needs_one(real_model_dir: Path) -> None:
    with served(real_model_dir, keys=(KEY,)) as (client, state):
        join(state.registry, "decode-0", "decode", "host-a")
        missing = client.get("/v1/cluster")
        wrong = client.get("/v1/cluster", headers={"Authorization": "Bearer sk-wrong"})
        body = cluster(client, Authorization=f"Bearer {KEY}")
    for refused in (missing, wrong):
        assert refused.status_code == 401
        assert error_of(refused)["code"] == "invalid_api_key"
    assert [w["id"] for w in body["workers"]] == ["decode-0"]


def test_only_get_is_allowed(real_model_dir: Path) -> None:
    with served(real_model_dir) as (client, _):
        response = client.post("/v1/cluster", json={})
    assert response.status_code == 405 and error_of(response)["type"] == "invalid_request_error"
