"""A cluster across three hosts, each a network namespace with its own host name and /dev/shm:
the gateway on one, a prefill and a decode worker on the second, a decode worker on the third,
joined by veth pairs to a bridge (real TCP, real addresses, CURVE). Greedy output equals the
reference; KV goes through shared memory to the decode worker on the prefill's host and over
TCP to the other; cutting the third host's link is detected within 3 s and its streams resume
on the other decode worker, none lost."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from transformers import PreTrainedTokenizerBase

from bench.client import auth_headers
from bench.launcher import stop
from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import ROOT, TEST_CONFIG, sse_events, wait_for

pytestmark = pytest.mark.e2e

SUBNET = "198.18.77"  # RFC 2544's range for testing networks: no real host lives there
API_KEY = "sk-multi-host-test"
CONTROL_PORT, HTTP_PORT = 7100, 7000
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "Hello",
           "Paris is the capital of", "1, 2, 3, 4,", "Roses are red,", "SELECT * FROM"]
MAX_TOKENS = 400
CONFIG: dict[str, Any] = {**TEST_CONFIG,
                          "gateway": {**TEST_CONFIG["gateway"], "heartbeat_timeout_s": 2.5},
                          "decode": {**TEST_CONFIG["decode"], "max_running": 4}}


@dataclass(frozen=True)
class Host:
    name: str  # its namespace, host name, and the suffix of its interfaces
    address: str


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def namespaces_problem() -> str | None:
    """Why this machine cannot make network namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"rgprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"ip netns add failed: {exc.stderr.decode(errors='replace').strip()}"
    _run("ip", "netns", "del", probe)
    return None


@contextmanager
def network(names: list[str]) -> Iterator[list[Host]]:
    """One namespace per name on a bridge in a namespace of its own, and a veth from this
    namespace to the bridge (the client's way in); all removed afterwards."""
    tag = str(os.getpid() % 100000)
    switch, root_if = f"rgsw{tag}", f"rgc{tag}"
    hosts = [Host(f"rg{name}{tag}", f"{SUBNET}.{i + 1}") for i, name in enumerate(names)]
    made: list[str] = []
    try:
        _run("ip", "netns", "add", switch)
        made.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            _run("ip", "netns", "add", host.name)
            made.append(host.name)
            _attach(switch, f"rgv{i}{tag}", f"rgs{i}{tag}", host.name)
            _run("ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.name, "link", "set", "eth0", "up")
            _run("ip", "-n", host.name, "link", "set", "lo", "up")
        _attach(switch, root_if, f"rgsc{tag}", None)
        _run("ip", "addr", "add", f"{SUBNET}.254/24", "dev", root_if)
        _run("ip", "link", "set", root_if, "up")
        yield hosts
    finally:
        subprocess.run(["ip", "link", "del", root_if], capture_output=True, check=False)
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _attach(switch: str, inner: str, outer: str, namespace: str | None) -> None:
    """A veth pair: `outer` on the switch's bridge, `inner` in `namespace` as eth0 (or left in
    this namespace)."""
    _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
    _run("ip", "link", "set", outer, "netns", switch)
    _run("ip", "-n", switch, "link", "set", outer, "master", "br0")
    _run("ip", "-n", switch, "link", "set", outer, "up")
    if namespace is not None:
        _run("ip", "link", "set", inner, "netns", namespace)
        _run("ip", "-n", namespace, "link", "set", inner, "name", "eth0")


@contextmanager
def on_host(host: Host, run_dir: Path, flags: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """launch.sh on `host`: its network namespace, its own host name and /dev/shm."""
    run_dir.mkdir(parents=True)
    script = (f"hostname {host.name} && mount -t tmpfs tmpfs /dev/shm && "
              f"exec {ROOT}/scripts/launch.sh \"$@\"")
    command = ["ip", "netns", "exec", host.name, "unshare", "--uts", "--mount",
               "--propagation", "private", "sh", "-c", script, "launch",
               *flags, "--run-dir", str(run_dir)]
    with (run_dir / "launch.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            yield process
        finally:
            stop(process, run_dir, signal.SIGINT)  # at once: a lost host has nowhere to drain


def test_a_cluster_across_three_hosts_survives_losing_one(
        tiny_model_dir: Path, tmp_path: Path, tokenizer: PreTrainedTokenizerBase,
        reference: Callable[[list[int], int], list[int]]) -> None:
    problem = namespaces_problem()
    if problem is not None:
        pytest.skip(problem)
    expected = {p: decode_text(tokenizer, reference(tokenizer.encode(p), MAX_TOKENS),
                               skip_special_tokens=True) for p in PROMPTS}
    config, keys = tmp_path / "config.yaml", tmp_path / "keys"
    config.write_text(yaml.safe_dump(CONFIG))
    common = ["--config", str(config), "--model", str(tiny_model_dir), "--keys", str(keys)]
    subprocess.run([sys.executable, "-m", "core.curve", "generate", str(keys)],
                   check=True, capture_output=True)
    with network(["gw", "pd", "dd"]) as (gateway, mixed, far), ExitStack() as stack:
        control = f"tcp://{gateway.address}:{CONTROL_PORT}"
        stack.enter_context(on_host(gateway, tmp_path / "gw", [
            "--gateway-only", "--control", f"tcp://0.0.0.0:{CONTROL_PORT}", "--host", "0.0.0.0",
            "--port", str(HTTP_PORT), "--api-key", API_KEY, *common]))
        stack.enter_context(on_host(mixed, tmp_path / "pd", [
            "--join", control, "--prefill", "1", "--decode", "1", *common]))
        stack.enter_context(on_host(far, tmp_path / "dd", [
            "--join", control, "--decode", "1", *common]))
        client = stack.enter_context(httpx.Client(
            base_url=f"http://{gateway.address}:{HTTP_PORT}", timeout=120,
            headers=auth_headers(API_KEY)))
        wait_for(lambda: _pools(client) == (1, 2), 180, "1 prefill + 2 decode workers")
        view = client.get("/v1/cluster").json()["workers"]
        far_decode = next(w["id"] for w in view if w["host"] == far.name)
        assert {w["host"] for w in view} == {mixed.name, far.name}

        model = client.get("/v1/models").json()["data"][0]["id"]
        with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            futures = [pool.submit(_stream, client, model, p) for p in PROMPTS * 2]
            wait_for(lambda: (_worker(client, far_decode).get("running") or 0) > 0, 60,
                     "streams generating on the far host")
            on_far = _worker(client, far_decode)["requests"]
            _run("ip", "-n", far.name, "link", "set", "eth0", "down")  # the host drops off
            cut = time.monotonic()
            wait_for(lambda: far_decode not in {w["id"] for w in
                                                client.get("/v1/cluster").json()["workers"]},
                     10, "the far decode worker declared dead")
            detected_s = time.monotonic() - cut
            results = [future.result(timeout=180) for future in futures]
        resumed = _metric(client, "raging_requests_resumed_total")
        shm_chunks = _metric(client, "raging_kv_transfer_chunks_total",
                             'worker="prefill-', 'backend="shm",direction="send"')
        tcp_chunks = _metric(client, "raging_kv_transfer_chunks_total",
                             'worker="prefill-', 'backend="zmq",direction="send"')
    for prompt, result in zip(PROMPTS * 2, results, strict=True):
        assert result["errors"] == [] and result["done"], prompt
        assert result["text"] == expected[prompt], prompt
    assert detected_s <= 3.0, f"the lost host was noticed after {detected_s:.2f} s"
    assert resumed >= on_far > 0  # every stream of the far host resumed, none lost
    assert shm_chunks > 0 and tcp_chunks > 0  # one pair on one host, one across hosts
    print(f"lost host detected in {detected_s:.2f} s; {on_far} streams on it, "
          f"{resumed:.0f} resumed; KV chunks sent: {shm_chunks:.0f} shm, {tcp_chunks:.0f} tcp")


def _pools(client: httpx.Client) -> tuple[int, int]:
    try:
        health = client.get("/health").json()
    except httpx.TransportError:
        return 0, 0
    return health.get("prefill", 0), health.get("decode", 0)


def _worker(client: httpx.Client, worker_id: str) -> dict[str, Any]:
    """The worker as /v1/cluster shows it ({} once it is gone)."""
    view = client.get("/v1/cluster").json()["workers"]
    return next((w for w in view if w["id"] == worker_id), {})


def _stream(client: httpx.Client, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    chunks = [e for e in events if isinstance(e, dict)]
    return {"text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")),
            "errors": [c for c in chunks if "error" in c], "done": events[-1] == "[DONE]"}


def _metric(client: httpx.Client, name: str, *parts: str) -> float:
    """The sum of `name`'s samples whose labels contain every one of `parts`."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.partition("{")[0] == name and all(part in key for part in parts):
            total += float(value)
    return total
