"""A worker's health endpoint on loopback, for probes run inside its container (Kubernetes exec
probes and its preStop hook), off unless `health_port` is set:

- `GET /ready`: 200 while registered with the gateway and not draining, else 503;
- `GET /live`: 200 while the worker's loop went round within `stall_s`, else 503;
- `POST /drain`: drain as on SIGTERM (202).

`python -m core.health ready|live|drain PORT` is the probe: exit status 0 when the answer is
200 (or 202), 1 otherwise; `drain` then waits until the worker has left (its port closes).
It binds loopback only, since `/drain` acts: nothing outside the container may call it.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class HealthState:
    """What the endpoint reports, read from the worker each time it is asked."""

    registered: bool
    draining: bool
    loop_age_s: float  # since the worker's loop last went round


class HealthServer:
    """The endpoint, serving from a daemon thread until `close`."""

    def __init__(self, port: int, state: Callable[[], HealthState], drain: Callable[[], None],
                 stall_s: float) -> None:
        handler = _handler(state, drain, stall_s)
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="health",
                                       daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(state: Callable[[], HealthState], drain: Callable[[], None],
             stall_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            now = state()
            if self.path == "/ready":
                self._answer(now.registered and not now.draining, now)
            elif self.path == "/live":
                self._answer(now.loop_age_s < stall_s, now)
            else:
                self._reply(404, {"error": "GET /ready or /live"})

        def do_POST(self) -> None:
            if self.path != "/drain":
                self._reply(404, {"error": "POST /drain"})
                return
            drain()
            self._reply(202, {"state": "draining"})

        def _answer(self, ok: bool, now: HealthState) -> None:
            self._reply(200 if ok else 503, {"registered": now.registered,
                                             "draining": now.draining,
                                             "loop_age_s": round(now.loop_age_s, 3)})

        def _reply(self, status: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds: not worth a log line each

    return Handler


def ask(port: int, method: str, path: str, timeout_s: float = 5.0) -> int:
    """The endpoint's status code for one request (OSError when nothing listens)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request(method, path)
        return connection.getresponse().status
    finally:
        connection.close()


def wait_gone(port: int, timeout_s: float) -> bool:
    """Whether the endpoint stopped answering (its worker left) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ask(port, "GET", "/live", timeout_s=1.0)
        except OSError:
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("ready", "live", "drain") or not argv[1].isdigit():
        print("usage: python -m core.health ready|live|drain PORT", file=sys.stderr)
        return 2
    command, port = argv[0], int(argv[1])
    try:
        if command == "drain":
            status = ask(port, "POST", "/drain")
            return 0 if status == 202 and wait_gone(port, timeout_s=3600) else 1
        return 0 if ask(port, "GET", f"/{command}") == 200 else 1
    except OSError as exc:
        print(f"no answer on port {port}: {exc}", file=sys.stderr)
        return 0 if command == "drain" else 1  # nothing left to drain


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
