"""A whole server started the way users start it (scripts/launch.sh), stopped by PID."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
import yaml
from transformers import AutoModelForCausalLM

from bench.client import auth_headers
from bench.launcher import free_port, stop, wait_ready
from core.pids import started_pids

ROOT = Path(__file__).resolve().parents[2]
REAL_LAUNCH_S = 420  # the real model: a loaded machine may build the kernels first

# Small pools so that tests start fast and leave memory for the rest of the suite.
TEST_CONFIG: dict[str, Any] = {
    # fp32, so that greedy tokens can equal transformers' own (bf16 on AMX CPUs is the default).
    "model": {"dtype": "float32"},
    # Grammar tables when a grammar first comes, as most clusters here see none: ~1.5 s of a CPU
    # less per worker (tests/e2e/test_structured_output.py builds them at start, as shipped).
    "engine": {"grammar_tables_at_start": False},
    # Pure disaggregation: every prompt to a prefill worker, repeated ones too (decode's cache,
    # the routing to it and pulls from it are for tests/e2e/test_conditional.py, test_pulls.py
    # and test_tenant_cache.py to turn on: `with_decode_cache`).
    "gateway": {"heartbeat_timeout_s": 3.0, "keepalive_s": 2.0, "local_prefill_max_tokens": 0,
                "prefill_saturated_tokens": 0, "pull_prefixes": "never"},
    "prefill": {"num_kv_blocks": 256, "block_size": 16, "threads": 1},
    "decode": {"num_kv_blocks": 256, "block_size": 16, "max_running": 64, "threads": 1,
               "prefix_caching": False},
    # OpenAI's neutral sampling defaults, which the tests' expectations (greedy output equal to
    # transformers', seeded draws) assume; tests/e2e/test_chat_ui_bodies.py runs the shipped ones.
    "generation_defaults": {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0},
}


def with_decode_cache(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with decode workers' prefix caching and pulls between workers on, as shipped."""
    return {**config, "gateway": {**config["gateway"], "pull_prefixes": "auto"},
            "decode": {**config["decode"], "prefix_caching": True}}


class Cluster:
    def __init__(self, launcher: subprocess.Popen[bytes], run_dir: Path, url: str,
                 api_key: str | None = None) -> None:
        self.launcher = launcher
        self.run_dir = run_dir
        self.url = url
        self.api_key = api_key
        self.client = httpx.Client(base_url=url, timeout=120, headers=auth_headers(api_key))
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def openai_client(self, timeout_s: float = 300) -> openai.OpenAI:
        """The official client, as its docs make it; no retries, so that a test sees every
        failure."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused",
                             max_retries=0, timeout=timeout_s)

    def pids(self) -> dict[str, int]:
        return started_pids(self.run_dir)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample's value from /metrics (`labels` like 'worker="decode-0"')."""
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in self.client.get("/metrics").text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == wanted:
                return float(value)
        raise KeyError(wanted)

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text()

    def decoding(self, worker: str = "decode-0") -> bool:
        """Whether `worker` runs one sequence."""
        return self.metric("raging_worker_running", f'worker="{worker}"') == 1

    def idle(self, worker: str = "decode-0") -> bool:
        """Whether `worker` holds no KV block and runs nothing, and the gateway no request."""
        labels = f'worker="{worker}"'
        return (self.metric("raging_kv_blocks_used", labels) == 0
                and self.metric("raging_worker_running", labels) == 0
                and self.metric("raging_requests_inflight") == 0)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        return False
    state = next((ln for ln in status.splitlines() if ln.startswith("State:")), "")
    return "zombie" not in state.lower()


@contextmanager
def launch(run_dir: Path, model: Path | str, prefill: int = 1, decode: int = 1,
           config: dict[str, Any] | None = None, timeout_s: float = 180,
           flags: Sequence[str] = (), api_key: str | None = None,
           cpus: Sequence[int] = (), open_files: int | None = None) -> Iterator[Cluster]:
    """Run scripts/launch.sh (plus extra `flags`) until it reports ready; stop everything it
    started afterwards. `api_key` is what the cluster's client sends (as Bearer); `cpus`, if
    any, the only CPUs launch.sh (and so every process it starts) may run on; `open_files`,
    the soft open-files limit they start with (the hard one as it is)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config or TEST_CONFIG))
    port = free_port()
    command = [str(ROOT / "scripts/launch.sh"), "--prefill", str(prefill), "--decode", str(decode),
               "--port", str(port), "--config", str(config_path), "--model", str(model),
               "--run-dir", str(run_dir), *flags]
    if cpus:
        command = ["taskset", "-c", ",".join(map(str, cpus)), *command]
    if open_files is not None:
        command = ["prlimit", f"--nofile={open_files}:", *command]
    log = (run_dir / "launch.log").open("wb")
    launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(launcher, run_dir, timeout_s)
        cluster = Cluster(launcher, run_dir, f"http://127.0.0.1:{port}", api_key)
        try:
            yield cluster
        finally:
            cluster.client.close()
    finally:
        stop(launcher, run_dir)
        log.close()


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `check()` held, asked every 50 ms; fails the test after `timeout_s`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


async def post_raw(url: str, path: str, body: dict[str, Any]
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A JSON POST over a connection of its own, plain asyncio (no client pool: thousands at
    once stay cheap, and a test may drop the connection at any byte); the reply unread. The
    server closes the connection once the reply is sent."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                 % (path.encode(), host.encode(), len(payload), payload))
    await writer.drain()
    return reader, writer


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """Parsed `data:` payloads of an SSE response: JSON chunks, and "[DONE]" as a string."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def greedy_reference(model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy continuation by transformers itself, EOS ignored (of a model folder, or of a GGUF
    file as transformers dequantizes it)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval() if model_dir.is_dir() else \
        AutoModelForCausalLM.from_pretrained(model_dir.parent, gguf_file=model_dir.name).eval()

    @torch.inference_mode()
    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        generated: list[int] = []
        for _ in range(max_tokens):
            generated.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([generated[-1:]]), past_key_values=out.past_key_values,
                        use_cache=True)
        return generated

    return generate
