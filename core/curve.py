"""CURVE authentication and encryption of the internal ZeroMQ channels (control and KV).

One keys folder serves a cluster:
- `server.key` / `server.key_secret`: the keypair of every server socket (the gateway's control
  ROUTER, each decode worker's KV ROUTER);
- `client.key` / `client.key_secret`: the keypair of every client socket (each worker's control
  DEALER, each prefill worker's KV DEALERs);
- `allowed_clients/*.key` (optional): more client public keys the servers admit, so that the
  client keypair can be replaced without stopping the servers.

A server admits a peer only if it proves it holds the secret of an admitted client key (a ZAP
handler checks it); a client talks only to a peer that holds the server secret. Peers turned away
never reach the socket's messages; each server counts them (`RejectedPeers`).

    python -m core.curve generate DIR
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from core.config import InternalConfig

log = logging.getLogger(__name__)

SERVER, CLIENT, ALLOWED = "server", "client", "allowed_clients"
ZAP_DOMAIN = "raging"
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
           zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_RESULTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED, *_FAILED)
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
for _event in _RESULTS:
    _WATCHED |= _event


@dataclass(frozen=True)
class CurveKeys:
    """A cluster's keys, z85-encoded as ZeroMQ takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed_clients: frozenset[bytes]  # client public keys that servers admit

    def __repr__(self) -> str:  # never print a secret into a log
        return f"CurveKeys(server={self.server_public!r}, clients={len(self.allowed_clients)})"


def generate(folder: Path) -> None:
    """Write a fresh server and client keypair into `folder` (mode 0700; key files 0600),
    replacing any there."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)  # mkdir's mode is cut by the umask, and the folder may be older
    for name in (SERVER, CLIENT):
        for path in zmq.auth.create_certificates(folder, name):
            os.chmod(path, 0o600)


def load(folder: Path) -> CurveKeys:
    """The keys in `folder`, as `generate` wrote them (plus any `allowed_clients/*.key`)."""
    server_public, server_secret = _keypair(folder, SERVER)
    client_public, client_secret = _keypair(folder, CLIENT)
    extra = folder / ALLOWED
    allowed = set(zmq.auth.load_certificates(extra)) if extra.is_dir() else set()
    return CurveKeys(server_public, server_secret, client_public, client_secret,
                     frozenset({client_public, *allowed}))


def keys_for(config: InternalConfig) -> CurveKeys | None:
    """The cluster's keys when `internal.curve` is on; None (plain ZeroMQ) when it is off."""
    return load(Path(config.keys_dir).expanduser()) if config.curve else None


def _keypair(folder: Path, name: str) -> tuple[bytes, bytes]:
    path = folder / f"{name}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"CURVE keys: cannot read {path}: {exc}") from None
    if secret is None:
        raise ValueError(f"CURVE keys: {path} holds no secret key")
    if path.stat().st_mode & 0o077:
        log.warning("CURVE keys: %s is readable by other users (chmod 600 it)", path)
    return public, secret


def make_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make `socket` (before it connects) a CURVE client that only talks to the cluster's
    servers."""
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)


class _AllowedClients:
    """The ZAP handler's verdict on a client key that completed the CURVE handshake."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key in self.keys


class CurveServer:
    """Makes a socket (before it binds) a CURVE server that admits only the cluster's clients,
    and counts the peers it turns away.

    The admission check (ZAP) runs in a thread of the socket's context, which serves every
    socket of that context: give each CURVE server socket a context of its own (workers and
    the gateway have one each). `close` before the socket's context terminates.
    """

    def __init__(self, socket: zmq.Socket, keys: CurveKeys) -> None:
        self.authenticator = ThreadAuthenticator(socket.context)
        self.authenticator.start()
        self.authenticator.configure_curve_callback(ZAP_DOMAIN, _AllowedClients(
            keys.allowed_clients))
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        self.rejected = RejectedPeers(socket)

    def close(self) -> None:
        self.rejected.close()
        self.authenticator.stop()


class RejectedPeers:
    """Counts the peers a server socket turned away, from its monitor events: a handshake that
    failed (no CURVE, wrong keys, a bad greeting, silence), or a connection that closed with no
    handshake result at all (a peer that does not speak ZMTP 3, say raw bytes or a pickle).

    A handshake result does not say which connection it belongs to: each is credited to the
    oldest connection still handshaking, which is exact unless handshakes overlap (then the
    count is right once the connections involved have closed).
    """

    def __init__(self, socket: zmq.Socket) -> None:
        address = f"inproc://raging-monitor-{uuid.uuid4().hex}"
        socket.monitor(address, _WATCHED)
        self.monitor = socket.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # a full queue would lose events: keep them all
        self.monitor.connect(address)
        self.handshaking: dict[int, None] = {}  # connections accepted, no result yet, by age
        self.count = 0

    def take_waiting(self) -> int:
        """Take the events waiting now (blocking sockets only); the count so far."""
        while True:
            try:
                self._on(self.monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return self.count

    async def watch(self) -> None:
        """Take events as they come (asyncio sockets only), until cancelled."""
        while True:
            self._on(await self.monitor.recv_multipart())

    def _on(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        if self._is_rejection(event["event"], event["value"]):
            self.count += 1
            if _worth_logging(self.count):
                log.warning("turned away %d unauthenticated peer(s) of %s so far", self.count,
                            event["endpoint"].decode(errors="replace"))

    def _is_rejection(self, kind: int, value: int) -> bool:
        """Book one monitor event; whether it tells of a peer turned away."""
        if kind == zmq.EVENT_ACCEPTED:
            self.handshaking[value] = None  # value: the connection's file descriptor
            return False
        if kind == zmq.EVENT_DISCONNECTED:
            if value not in self.handshaking:
                return False  # a failed handshake, counted already, or a peer that was in
            del self.handshaking[value]
            return True
        if kind in _RESULTS and self.handshaking:
            del self.handshaking[next(iter(self.handshaking))]
        return kind in _FAILED

    def close(self) -> None:
        self.monitor.close(linger=0)


def _worth_logging(count: int) -> bool:
    """1, 10, 100, ...: an attack or a misconfigured peer shows in the log without flooding it."""
    return str(count).rstrip("0") == "1"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m core.curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("generate", help="write fresh keys into a folder")
    make.add_argument("folder", type=Path)
    args = parser.parse_args()
    generate(args.folder)
    print(f"CURVE keys written to {args.folder}")


if __name__ == "__main__":
    main()
