"""The control channel drops, duplicates, delays and reorders messages of every type between
real workers and the real gateway: every request still reaches a terminal state by its deadline,
and the server serves cleanly once the faults stop."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
import zmq

from bench.launcher import free_port
from core.codec import MalformedMessage
from core.messages import Leave, Register, RegisterAgain, RegisterReply, decode
from tests.e2e.cluster import ROOT, TEST_CONFIG, alive

pytestmark = pytest.mark.e2e

MEMBERSHIP = (Register, RegisterReply, RegisterAgain, Leave)  # kept: workers must join
DROP, DUPLICATE, DELAY_MAX_S = 0.05, 0.05, 0.15
PROMPT_LENGTHS = (1, 15, 16, 17, 32)  # 1, block - 1, a block, a block + 1, two blocks
DEADLINE_S = 30.0


class FaultyProxy:
    """Sits between workers (who connect to `address`) and the gateway: each message, either
    way, may be dropped, sent twice, or held back a while (which reorders it)."""

    def __init__(self, context: zmq.Context, address: str, gateway: str, seed: int) -> None:
        self.context = context
        self.gateway = gateway
        self.front = context.socket(zmq.ROUTER)
        self.front.bind(address)
        self.backs: dict[bytes, zmq.Socket] = {}
        self.rng = random.Random(seed)
        self.held: list[tuple[float, int, zmq.Socket, list[bytes]]] = []
        self.order = itertools.count()  # breaks ties in `held` (sockets do not compare)
        self.faults: Counter[str] = Counter()
        self.faulty = True
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _back(self, identity: bytes) -> zmq.Socket:
        if identity not in self.backs:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, identity)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.gateway)
            self.backs[identity] = socket
        return self.backs[identity]

    def _pass(self, socket: zmq.Socket, frames: list[bytes]) -> None:
        """Forward `frames` on `socket`, perhaps faultily."""
        try:
            kind = type(decode(frames[-1]))
        except MalformedMessage:
            kind = None
        if not self.faulty or kind in MEMBERSHIP:
            socket.send_multipart(frames)
            return
        name = getattr(kind, "__name__", "malformed")
        roll = self.rng.random()
        if roll < DROP:
            self.faults[f"dropped {name}"] += 1
            return
        copies = 2 if roll < DROP + DUPLICATE else 1
        if copies == 2:
            self.faults[f"duplicated {name}"] += 1
        for _ in range(copies):
            delay = self.rng.uniform(0, DELAY_MAX_S) if self.rng.random() < 0.3 else 0.0
            self.faults[f"delayed {name}"] += delay > 0
            heapq.heappush(self.held, (time.monotonic() + delay, next(self.order), socket, frames))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.stopping:
            for socket in self.backs.values():
                poller.register(socket, zmq.POLLIN)
            for socket, _ in poller.poll(5):
                if socket is self.front:
                    identity, data = socket.recv_multipart()
                    self._pass(self._back(identity), [data])
                else:
                    data = socket.recv()
                    identity = socket.getsockopt(zmq.IDENTITY)
                    self._pass(self.front, [identity, data])
            now = time.monotonic()
            while self.held and self.held[0][0] <= now:
                _, _, target, frames = heapq.heappop(self.held)
                target.send_multipart(frames)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)
        for socket in [self.front, *self.backs.values()]:
            socket.close(linger=0)


@pytest.fixture
def fuzzed(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path,
           ) -> Iterator[tuple[str, FaultyProxy]]:
    # Short enough that a request no resume rescues still ends by DEADLINE_S; long enough for
    # two resumes back to back (3 s each at most).
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"], "progress_timeout_s": 12.0}}
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    gateway_control, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    context = zmq.Context()
    proxy = FaultyProxy(context, f"ipc://{tmp_path}/proxy.sock", gateway_control,
                        seed=request.param)
    common = ["--config", str(config_path), "--model", str(tiny_model_dir)]
    commands = [
        ["gateway", "--control-address", gateway_control, "--port", str(port),
         "--expect-prefill", "1", "--expect-decode", "1"],
        ["prefill", "--control-address", f"ipc://{tmp_path}/proxy.sock"],
        ["decode", "--control-address", f"ipc://{tmp_path}/proxy.sock"],
    ]
    processes = [subprocess.Popen([sys.executable, "-m", name, *common, *rest], cwd=ROOT,
                                  stderr=(tmp_path / f"{name}.log").open("wb"))
                 for name, *rest in commands]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert time.monotonic() < deadline, "the fuzzed server never became ready"
            assert all(p.poll() is None for p in processes), "a process died at start"
            time.sleep(0.3)
        yield url, proxy
    finally:
        # SIGINT stops a worker at once (SIGTERM would drain it, waiting for the gateway's
        # word, which never comes from a gateway stopped beside it), as launch.sh stops them
        for process in processes:
            process.send_signal(signal.SIGINT)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        assert not any(alive(p.pid) for p in processes)
        proxy.close()
        context.term()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def outcome(client: httpx.AsyncClient, model: str, prompt_len: int, stream: bool) -> str:
    """How one request ended: 'finished', 'error event: why', 'http NNN: why' or
    'no terminal state'."""
    body = {"model": model, "prompt": list(range(100, 100 + prompt_len)), "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    try:
        async with asyncio.timeout(DEADLINE_S):
            if not stream:
                response = await client.post("/v1/completions", json=body)
                return "finished" if response.status_code == 200 else _failed(response)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return _failed(response)
                lines = [line async for line in response.aiter_lines() if line]
    except TimeoutError:
        return "no terminal state"
    if lines[-1] == "data: [DONE]" and any('"finish_reason":"length"' in ln.replace(" ", "")
                                          for ln in lines):
        return "finished"
    errors = [json.loads(ln.removeprefix("data: "))["error"]["message"]
              for ln in lines if '"error"' in ln]
    return f"error event: {errors[0]}" if errors else "no terminal state"


def _failed(response: httpx.Response) -> str:
    try:
        why = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        why = response.text[:200]
    return f"http {response.status_code}: {why}"


async def run_all(url: str, count: int) -> Counter[str]:
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S + 5) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        results = await asyncio.gather(*(
            outcome(client, model, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], i % 2 == 0)
            for i in range(count)))
    return Counter(results)


def blocks_in_use(url: str) -> dict[str, float]:
    used = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("raging_kv_blocks_used{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            used[worker] = float(line.rsplit(" ", 1)[1])
    return used


@pytest.mark.parametrize("fuzzed", [11, 12], indirect=True)
def test_every_request_ends_by_its_deadline_under_control_faults(fuzzed) -> None:
    url, proxy = fuzzed
    started = time.monotonic()
    outcomes = asyncio.run(run_all(url, 60))
    assert outcomes["no terminal state"] == 0, outcomes
    # A lost message costs its request a resume, not the request: nearly all finish.
    assert outcomes["finished"] >= 54, outcomes
    assert time.monotonic() - started < DEADLINE_S + 10
    assert sum(v for k, v in proxy.faults.items() if k.startswith("dropped")) > 0
    proxy.faulty = False
    deadline = time.monotonic() + 30  # a worker declared dead meanwhile registers again
    while not _healthy(url):
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.3)
    clean = asyncio.run(run_all(url, 10))
    assert clean == Counter({"finished": 10}), clean
    deadline = time.monotonic() + 10
    while (used := blocks_in_use(url)) != {"prefill-0": 0, "decode-0": 0}:
        assert time.monotonic() < deadline, f"KV blocks still held: {used}"
        time.sleep(0.3)
    print(f"60 requests under faults: {dict(outcomes)}; faults {dict(proxy.faults)}; "
          f"then 10 clean requests all finished")
