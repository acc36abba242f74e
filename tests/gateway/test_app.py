"""The app's middleware as browsers meet it: CORS preflights, before and beside API keys."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.served_app import NO_WORKER, error_of, serve_without_workers, valid_body

CHAT = "/v1/chat/completions"
PAGE = "http://chat.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_preflight_is_answered_for_any_origin_by_default(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir) as client:
        preflight = client.options(CHAT, headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        reply = client.post(CHAT, json=valid_body(CHAT), headers={"Origin": PAGE})
        assert error_of(reply)["message"] == NO_WORKER
        assert reply.headers["access-control-allow-origin"] == "*"


def test_a_preflight_needs_no_key_but_the_request_does(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir, **{"auth.api_keys": ("sk-one",)}) as client:
        assert client.options(CHAT, headers=PREFLIGHT).status_code == 200
        refused = client.post(CHAT, json=valid_body(CHAT), headers={"Origin": PAGE})
        assert refused.status_code == 401  # and readable by the page, to show why
        assert refused.headers["access-control-allow-origin"] == "*"
        allowed = client.post(CHAT, json=valid_body(CHAT),
                              headers={"Origin": PAGE, "Authorization": "Bearer sk-one"})
        assert error_of(allowed)["message"] == NO_WORKER


def test_origins_can_be_narrowed_or_refused(real_model_dir: Path) -> None:
    with serve_without_workers(real_model_dir,
                               **{"gateway.allowed_origins": (PAGE,)}) as client:
        assert client.options(CHAT, headers=PREFLIGHT).headers[
            "access-control-allow-origin"] == PAGE
        other = client.options(CHAT, headers={**PREFLIGHT, "Origin": "http://elsewhere.example"})
        assert other.status_code == 400
    with serve_without_workers(real_model_dir, **{"gateway.allowed_origins": ()}) as client:
        assert client.options(CHAT, headers=PREFLIGHT).status_code == 405
        reply = client.post(CHAT, json=valid_body(CHAT), headers={"Origin": PAGE})
        assert "access-control-allow-origin" not in reply.headers
