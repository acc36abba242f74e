"""CURVE keys (generate, load, permissions) and a CURVE server socket: the cluster's client
talks; a peer without CURVE, with other keys, or speaking raw bytes gets nothing through, and
each such peer is counted."""

from __future__ import annotations

import pickle
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from core.config import InternalConfig
from core.curve import CurveKeys, CurveServer, generate, keys_for, load, make_client

WAIT_S = 5.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    generate(tmp_path / "keys")
    return load(tmp_path / "keys")


def other_keys() -> CurveKeys:
    """Keys of a different cluster (an attacker's, or a stale keys folder)."""
    (server_public, server_secret), (client_public, client_secret) = (
        zmq.curve_keypair(), zmq.curve_keypair())
    return CurveKeys(server_public, server_secret, client_public, client_secret,
                     frozenset({client_public}))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_writes_private_keypairs_that_load_back(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "keys"
    generate(folder)
    assert mode(folder) == 0o700
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert all(mode(folder / name) == 0o600 for name in names)
    keys = load(folder)
    assert keys.allowed_clients == {keys.client_public}
    assert zmq.auth.load_certificate(folder / "server.key") == (keys.server_public, None)
    assert keys.server_secret not in repr(keys).encode()
    assert keys.client_secret not in repr(keys).encode()


def test_generate_again_makes_new_keys_and_tightens_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o755)
    generate(folder)
    first = load(folder)
    generate(folder)
    assert mode(folder) == 0o700
    assert load(folder).server_public != first.server_public


def test_extra_client_keys_in_allowed_clients_are_admitted(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    generate(folder)
    (folder / "allowed_clients").mkdir()
    public_path, _ = zmq.auth.create_certificates(folder / "allowed_clients", "next")
    extra, _ = zmq.auth.load_certificate(public_path)
    keys = load(folder)
    assert keys.allowed_clients == {keys.client_public, extra}


def test_missing_or_public_only_keys_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"server\.key_secret"):
        load(tmp_path)
    generate(tmp_path)
    (tmp_path / "client.key_secret").write_bytes((tmp_path / "client.key").read_bytes())
    with pytest.raises(ValueError, match="no secret key"):
        load(tmp_path)


def test_keys_come_from_the_config_only_when_curve_is_on(tmp_path: Path) -> None:
    generate(tmp_path)
    assert keys_for(InternalConfig()) is None
    assert keys_for(InternalConfig(curve=False, keys_dir=str(tmp_path))) is None
    assert keys_for(InternalConfig(curve=True, keys_dir=str(tmp_path))) == load(tmp_path)
    with pytest.raises(ValueError, match="keys_dir"):
        InternalConfig(curve=True)


def test_the_command_line_generates_keys(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "core.curve", "generate", str(folder)], cwd=ROOT,
                   check=True, capture_output=True)
    assert mode(folder) == 0o700 and load(folder).client_public


# --- a CURVE server socket -------------------------------------------------------------------


@pytest.fixture
def server(context: zmq.Context, keys: CurveKeys) -> Iterator[tuple[zmq.Socket, CurveServer]]:
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    curve = CurveServer(router, keys)
    router.bind("tcp://127.0.0.1:*")
    yield router, curve
    router.close(linger=0)
    curve.close()


def dealer(context: zmq.Context, router: zmq.Socket, keys: CurveKeys | None) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(socket, keys)
    socket.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    return socket


def received(router: zmq.Socket, wait_s: float = 0.5) -> list[list[bytes]]:
    got = []
    while router.poll(int(wait_s * 1000)):
        got.append(router.recv_multipart())
    return got


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_clusters_client_talks_and_is_not_counted(
    context: zmq.Context, server: tuple[zmq.Socket, CurveServer], keys: CurveKeys
) -> None:
    router, curve = server
    client = dealer(context, router, keys)
    client.send(b"hello")
    assert router.poll(int(WAIT_S * 1000))
    assert router.recv_multipart()[1:] == [b"hello"]
    client.close()
    time.sleep(0.1)
    assert curve.rejected.take_waiting() == 0


@pytest.mark.parametrize("peer", ["plain", "other client keys", "other server key"])
def test_a_peer_without_the_clients_keys_gets_nothing_through_and_is_counted(
    context: zmq.Context, server: tuple[zmq.Socket, CurveServer], keys: CurveKeys, peer: str
) -> None:
    router, curve = server
    client_keys = {"plain": None, "other client keys": other_keys(),
                   "other server key": CurveKeys(
                       other_keys().server_public, b"", keys.client_public, keys.client_secret,
                       frozenset())}[peer]
    client = dealer(context, router, client_keys)
    client.send(pickle.dumps({"evil": True}))
    wait_for(lambda: curve.rejected.take_waiting() >= 1)
    assert received(router) == []
    client.close()


@pytest.mark.parametrize("payload", [b"", b"\x00" * 64, b"\xff" + bytes(range(200)),
                                     pickle.dumps(("not", "unpickled"))])
def test_raw_bytes_are_dropped_and_counted(
    server: tuple[zmq.Socket, CurveServer], payload: bytes
) -> None:
    router, curve = server
    host, port = router.getsockopt_string(zmq.LAST_ENDPOINT)[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(payload)
        time.sleep(0.1)
    wait_for(lambda: curve.rejected.take_waiting() == 1)
    assert received(router, 0.2) == []


def test_a_rejected_peer_does_not_stop_the_client_after_it(
    context: zmq.Context, server: tuple[zmq.Socket, CurveServer], keys: CurveKeys
) -> None:
    router, curve = server
    intruder = dealer(context, router, None)
    intruder.send(b"intruder")
    wait_for(lambda: curve.rejected.take_waiting() >= 1)
    intruder.close()
    client = dealer(context, router, keys)
    client.send(b"worker")
    assert [frames[1:] for frames in received(router)] == [[b"worker"]]
