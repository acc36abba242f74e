"""Addresses: whether one serves this machine only, and which of this host's addresses other
hosts reach it on (`python -m core.netaddr route-source ADDRESS` prints the local address of
the route to ADDRESS, tcp://HOST:PORT or a bare host, which launch.sh gives decode workers to
receive KV on; no packet is sent)."""

from __future__ import annotations

import ipaddress
import socket
import sys
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (a host name counts as not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_endpoint(address: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only (ipc, or tcp on loopback)."""
    return not address.startswith("tcp://") or is_loopback(urlsplit(address).hostname or "")


def route_source(address: str) -> str:
    """This host's IP address on the route to `address`; OSError where there is none."""
    host = urlsplit(address).hostname if "://" in address else address
    if not host:
        raise ValueError(f"no host in {address!r}")
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)  # a UDP connect picks the route and sends nothing
        return str(probe.getsockname()[0])


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "route-source":
        print("usage: python -m core.netaddr route-source ADDRESS", file=sys.stderr)
        return 2
    try:
        print(route_source(argv[1]))
    except (OSError, ValueError) as exc:
        print(f"no route to {argv[1]}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
