"""The benchmark's API key: sent as Bearer, and hidden in every command line it prints or keeps."""

from __future__ import annotations

from bench.client import auth_headers
from bench.launcher import redact
from bench.serve import Target


def test_the_key_goes_as_a_bearer_header() -> None:
    assert auth_headers("sk-a") == {"Authorization": "Bearer sk-a"}
    assert auth_headers(None) == {} and auth_headers("") == {}


def test_redact_hides_every_form_of_the_flag() -> None:
    words = ["serve", "--api-key", "sk-a", "--api-key=sk-b", "--launch",
             "p1=--prefill 1 --api-key sk-c --decode 1", "--model", "m"]
    assert redact(words) == ("serve", "--api-key", "***", "--api-key=***", "--launch",
                             "p1=--prefill 1 --api-key *** --decode 1", "--model", "m")
    assert redact(["--api-key-file", "/keys"]) == ("--api-key-file", "/keys")


def test_a_launch_label_hides_the_key() -> None:
    target = Target.from_launch("--prefill 1 --api-key sk-secret:alpha")
    assert "sk-secret" not in target.label and target.launch_flags is not None
    assert "sk-secret:alpha" in target.launch_flags  # launch.sh still gets it
