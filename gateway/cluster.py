"""`GET /v1/cluster`: the whole cluster as JSON, for the web page's live view (and for people).

One snapshot of the gateway's own view: every registered worker with the load its last
heartbeat reported, the requests in flight, recent TTFT/TPOT, the conditional-disaggregation
decisions so far, and the newest membership events. Like every /v1 route it needs the API key
when keys are set.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.registry import Registry, WorkerInfo
from gateway.routing import ROUTE_PATHS
from gateway.state import GatewayState


def worker_view(worker: WorkerInfo, now: float) -> dict[str, Any]:
    """One worker as the cluster view shows it; load fields are None before its first
    heartbeat."""
    load = worker.load
    used = None if load is None else worker.num_blocks - load.free_blocks
    return {
        "id": worker.worker_id, "role": worker.role, "host": worker.host, "isa": worker.isa,
        "cpus": list(worker.cpus), "threads": worker.threads,
        "state": _state(worker), "stalled": worker.stalled,
        "last_heartbeat_s": round(now - worker.last_seen, 3),
        "kv_blocks_used": used, "kv_blocks_total": worker.num_blocks,
        "block_size": worker.block_size,
        "running": None if load is None else load.running,
        "waiting": None if load is None else load.waiting,
        "queued_tokens": None if load is None else load.queued_tokens,
        "in_transfer": None if load is None else load.in_transfer,
        "preemptions": None if load is None else load.preemptions,
        "requests": len(worker.active), "held_tokens": worker.held_tokens,
    }


def _state(worker: WorkerInfo) -> str:
    """"draining" (finishing its work before it leaves), "stalled" (not routed to),
    "unreachable" (its KV socket failed a sender until its next heartbeat), "joining" (no
    heartbeat yet) or "serving"."""
    if worker.draining:
        return "draining"
    if worker.stalled:
        return "stalled"
    if worker.unreachable:
        return "unreachable"
    return "joining" if worker.load is None else "serving"


def cluster_view(state: GatewayState) -> dict[str, Any]:
    """The snapshot `GET /v1/cluster` returns."""
    registry, now = state.registry, time.monotonic()
    handles = list(state.dispatcher.requests.values())
    return {
        "object": "cluster", "model": state.model_name, "time": time.time(),
        "status": registry.health(), "expected": registry.expected,
        "workers": [worker_view(w, now) for w in _ordered(registry)],
        "requests": {"in_flight": len(handles),
                     "awaiting_first_token": sum(not h.output.delivered for h in handles),
                     "queued_prompt_tokens": registry.queued_prompt_tokens()},
        "latency": state.metrics.recent.snapshot(),
        "decisions": {path: state.router.decisions[path] for path in ROUTE_PATHS},
        "refused_registrations": registry.refused,
        "events": [dataclasses.asdict(event) for event in registry.events],
    }


def _ordered(registry: Registry) -> list[WorkerInfo]:
    """Prefill workers first, then decode, each by id."""
    return sorted(registry.workers.values(), key=lambda w: (w.role != "prefill", w.worker_id))


def cluster_route(state: GatewayState) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint for `state`."""

    async def cluster(request: Request) -> Response:
        return JSONResponse(cluster_view(state), headers={"Cache-Control": "no-store"})

    return cluster
