"""Every reply's X-Request-Id: the client's own when sane, else a fresh one, on every route and
status (an error, a refused key, an unknown route included)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.gateway.served_app import error_of, serve_without_workers, valid_body

CHAT = "/v1/chat/completions"
FRESH = re.compile(r"req_[0-9a-f]{32}")


def test_each_reply_gets_a_fresh_id_unless_the_client_sent_one(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir) as client:
        ids = [client.get("/health").headers["x-request-id"] for _ in range(3)]
        assert all(FRESH.fullmatch(i) for i in ids) and len(set(ids)) == 3
        for path, body in ((CHAT, valid_body(CHAT)), ("/v1/embeddings", {"input": "x"}),
                           ("/no/such/route", {})):
            reply = client.post(path, json=body, headers={"X-Request-Id": "trace-42"})
            assert reply.status_code in (503, 404)
            assert reply.headers.get_list("x-request-id") == ["trace-42"], path
        refused = client.post(CHAT, content=b"{", headers={"X-Request-Id": "x" * 129})
        assert error_of(refused)["type"] == "invalid_request_error"
        assert FRESH.fullmatch(refused.headers["x-request-id"])  # too long to echo


def test_a_request_refused_for_its_key_carries_its_id(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir, **{"auth.api_keys": ("sk-one",)}) as client:
        refused = client.post(CHAT, json=valid_body(CHAT), headers={"X-Request-Id": "mine"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "mine"
