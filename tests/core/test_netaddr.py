"""Loopback addresses, local ZeroMQ endpoints, and the source address of a route."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.netaddr import is_local_endpoint, is_loopback, route_source


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("example.com", False),
])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("address", "local"), [
    ("ipc:///tmp/control.sock", True), ("tcp://127.0.0.1:8100", True),
    ("tcp://localhost:8100", True), ("tcp://0.0.0.0:8100", False),
    ("tcp://10.0.0.5:*", False), ("tcp://gateway.example:8100", False),
])
def test_local_endpoints(address: str, local: bool) -> None:
    assert is_local_endpoint(address) is local


def test_the_route_to_loopback_leaves_from_loopback() -> None:
    assert route_source("tcp://127.0.0.1:8100") == "127.0.0.1"
    assert route_source("127.0.0.5") == "127.0.0.1"


def test_the_command_names_the_source_or_says_why_not() -> None:
    ok = subprocess.run([sys.executable, "-m", "core.netaddr", "route-source",
                         "tcp://127.0.0.1:1"], capture_output=True, text=True, check=False)
    assert (ok.returncode, ok.stdout.strip()) == (0, "127.0.0.1")
    bad = subprocess.run([sys.executable, "-m", "core.netaddr", "route-source",
                          "tcp://no-such-host.invalid:1"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 1 and "no route to" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "core.netaddr"], capture_output=True,
                           text=True, check=False)
    assert usage.returncode == 2
