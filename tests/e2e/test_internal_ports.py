"""The internal ports of a real cluster (launch.sh turns CURVE on) turn strangers away: to the
gateway's control socket and to every decode worker's KV socket we send a pickle whose
unpickling would create a file, random bytes, and well-formed messages from DEALERs without the
cluster's keys. Nothing is processed (no file, no registration, no dropped-message count), every
stranger is counted in /metrics, and the cluster still answers correctly afterwards."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from core.curve import CurveKeys, load
from core.messages import Register, encode
from engine.weights.tokenizer import decode_text
from kvtransfer.wire import FORWARD_CODEC, KVNotice, as_bytes, checksum
from tests.e2e.cluster import Cluster, greedy_reference, launch
from tests.kvtransfer.conftest import header_for, kv

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "prefill", "decode", "kvtransfer", "engine", "core", "bench")
WAIT_S = 15.0
DECODE = 2


class CreatesFile:
    """Unpickling this opens (so creates) `path`: proof that someone unpickled socket data."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str, str]]:
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # zmq: the whole KV goes through the CURVE sockets (shm sends only headers through them).
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, decode=DECODE,
                flags=["--kv-backend", "zmq"]) as running:
        yield running


def test_launch_makes_private_keys_for_the_run(cluster: Cluster) -> None:
    folder = cluster.run_dir / "curve"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()} == {0o600}
    assert load(folder).allowed_clients == {load(folder).client_public}


def internal_ports(cluster: Cluster) -> dict[str, str]:
    """Who listens -> where: the gateway's control socket and each decode worker's KV one."""
    ports = {"gateway": f"ipc://{cluster.run_dir}/control.sock"}
    for i in range(DECODE):
        found = re.search(r"receiving KV at (\S+) \(CURVE\)", cluster.log(f"decode-{i}"))
        assert found, f"decode-{i} does not say where it receives KV with CURVE"
        ports[f"decode-{i}"] = found.group(1)
    return ports


def send_raw(address: str, payload: bytes) -> None:
    """Open a plain stream socket to a ZeroMQ tcp:// or ipc:// address and write `payload`."""
    if address.startswith("ipc://"):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(address[len("ipc://"):])
    else:
        host, port = address[len("tcp://"):].rsplit(":", 1)
        raw = socket.create_connection((host, int(port)))
    with raw:
        raw.sendall(payload)
        time.sleep(0.2)


def well_formed(name: str) -> list[list[bytes]]:
    """Messages the port would process from a peer it trusted."""
    if name == "gateway":
        return [[encode(Register("intruder", "i0", "decode", "tcp://127.0.0.1:9", "fp", 16, 1))]]
    k, v = kv(1)
    chunk = [FORWARD_CODEC.encode(header_for(k, v, request_id="intruder")),
             bytes(as_bytes(k)), bytes(as_bytes(v))]
    assert checksum(as_bytes(k), as_bytes(v)) == header_for(k, v).checksum
    return [chunk, [FORWARD_CODEC.encode(KVNotice("intruder", 0, b""))]]


def strangers(context: zmq.Context, address: str, keys: CurveKeys) -> list[zmq.Socket]:
    """DEALERs without the cluster's client key: one plain, one with a keypair of its own (it
    knows the server's public key, which is not a secret)."""
    plain = context.socket(zmq.DEALER)
    own = context.socket(zmq.DEALER)
    own.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    public, secret = zmq.curve_keypair()
    own.setsockopt(zmq.CURVE_PUBLICKEY, public)
    own.setsockopt(zmq.CURVE_SECRETKEY, secret)
    for dealer in (plain, own):
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IDENTITY, b"decode-0")  # would take over its routing, if let in
        dealer.connect(address)
    return [plain, own]


def offer(dealer: zmq.Socket, frames: list[bytes]) -> None:
    """Queue `frames` to go once the handshake succeeds (it will not); between two refused
    handshakes a DEALER may have nowhere to queue them, which is as good."""
    with contextlib.suppress(zmq.Again):
        dealer.send_multipart(frames, flags=zmq.NOBLOCK)


def rejected(cluster: Cluster) -> dict[str, float]:
    """Each internal socket's count of peers turned away; a decode worker's comes with its
    loop's heartbeats, so this waits for the first (a busy machine may hold it back a while)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return {name: cluster.metric("raging_internal_rejected_total", f'worker="{name}"')
                    for name in ["gateway", *(f"decode-{i}" for i in range(DECODE))]}
        except KeyError:
            assert time.monotonic() < deadline, "a decode worker never reported its load"
            time.sleep(0.3)


def wait_until_counted(cluster: Cluster, before: dict[str, float], at_least: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        now = rejected(cluster)
        if all(now[name] - before[name] >= at_least for name in before):
            return
        assert time.monotonic() < deadline, f"rejections before {before}, now {now}"
        time.sleep(0.3)


def test_strangers_on_internal_ports_are_dropped_counted_and_harmless(
    cluster: Cluster, tmp_path: Path, tiny_model_dir: Path,
) -> None:
    keys = load(cluster.run_dir / "curve")
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(CreatesFile(marker))
    ports = internal_ports(cluster)
    before, dropped_before = rejected(cluster), cluster.metric("raging_control_messages_dropped")
    context = zmq.Context()
    try:
        for name, address in ports.items():
            send_raw(address, evil)
            send_raw(address, os.urandom(4096))
            for dealer in strangers(context, address, keys):
                for frames in [*well_formed(name), [evil], [os.urandom(512)]]:
                    offer(dealer, frames)
        wait_until_counted(cluster, before, at_least=4)  # 2 raw connections + 2 DEALERs each
    finally:
        context.destroy(linger=0)
    assert not marker.exists()
    assert cluster.metric("raging_control_messages_dropped") == dropped_before
    metrics = cluster.client.get("/metrics").text
    assert not re.search(r"^raging_kv_chunks_dropped_total\{", metrics, re.MULTILINE)
    health = cluster.client.get("/health").json()
    assert (health["prefill"], health["decode"]) == (1, DECODE)  # no intruder registered
    assert_serves_correctly(cluster, tiny_model_dir)


def assert_serves_correctly(cluster: Cluster, model_dir: Path) -> None:
    prompt, max_tokens = "The quick brown fox", 12
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = greedy_reference(model_dir)(tokenizer.encode(prompt), max_tokens)
    expected = decode_text(tokenizer, reference, skip_special_tokens=True)
    for _ in range(DECODE):  # the decode workers take turns: reach each one
        response = cluster.client.post("/v1/completions", json={
            "model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected


def test_no_code_unpickles_anything() -> None:
    """Belt and braces for the test above: nothing in the code base can turn bytes into
    objects with pickle (pyzmq's recv_pyobj unpickles too)."""
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b|pickle\.loads?\("
                         r"|\bUnpickler\b|recv_pyobj|recv_serialized", re.MULTILINE)
    offenders = [str(path.relative_to(ROOT)) for package in PACKAGES
                 for path in (ROOT / package).rglob("*.py") if pattern.search(path.read_text())]
    assert offenders == []
