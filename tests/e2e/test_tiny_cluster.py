"""End to end on a tiny random Llama: 1 gateway + 2 prefill + 2 decode real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import (
    ROOT,
    TEST_CONFIG,
    Cluster,
    alive,
    launch,
    sse_events,
    started_pids,
    wait_for,
)

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The quick brown fox", "Once upon a time", "def fibonacci(n):", "Paris is the capital of",
    "1, 2, 3, 4,", "Hello", "In the beginning was the", "Roses are red,",
    "Le chat est", "日本の首都は", "import numpy as np\n", "The meaning of life is",
    "A", "Water boils at", "SELECT * FROM", "Dear Sir or Madam,",
]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, prefill=2, decode=2) as running:
        yield running


def stream_completion(cluster: Cluster, prompt: str, max_tokens: int, **extra: Any) -> dict:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    with cluster.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    return {"events": events, "text": "".join(c["choices"][0]["text"] for c in chunks),
            "finish": [c["choices"][0]["finish_reason"] for c in chunks if
                       c["choices"][0]["finish_reason"]],
            "usage": events[-2].get("usage") if isinstance(events[-2], dict) else None}


def test_sixteen_concurrent_streams_match_the_greedy_reference(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference
) -> None:
    max_tokens = 24
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: stream_completion(cluster, p, max_tokens), PROMPTS))
    for prompt, result in zip(PROMPTS, results, strict=True):
        prompt_ids = tokenizer.encode(prompt)
        expected = decode_text(tokenizer, reference(prompt_ids, max_tokens),
                               skip_special_tokens=True)
        assert result["text"] == expected, prompt
        assert result["finish"] == ["length"]
        assert result["events"][-1] == "[DONE]"
        n = len(prompt_ids)
        assert result["usage"] == {"prompt_tokens": n, "completion_tokens": max_tokens,
                                   "total_tokens": n + max_tokens,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    # Both pools took part.
    assert all(f"{w} registered" in cluster.log(w) for w in ("prefill-0", "prefill-1"))
    assert cluster.metric("raging_requests_total", 'outcome="ok",route="completions"') >= 16


def test_a_batch_of_prompts_gets_n_choices_each_in_order(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference
) -> None:
    """A list of prompts, as vLLM and OpenAI take it: choice p * n + i is prompt p's i-th."""
    prompts = ["A batch of prompts begins", "and goes on with a second", "then ends"]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    expected = [decode_text(tokenizer, reference(ids, 8), skip_special_tokens=True)
                for ids in prompt_ids]
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    fields: dict[str, Any] = {"model": cluster.model, "max_tokens": 8, "temperature": 0,
                              "n": 2, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=[prompts[0], prompt_ids[1], prompts[2]], **fields)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [text for text in expected for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert whole.usage.completion_tokens == 6 * 8
    texts = [""] * 6
    for chunk in client.completions.create(prompt=prompts, stream=True, **fields):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [choice.text for choice in whole.choices]


def test_requests_sharing_a_client_request_id_are_served_apart(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference
) -> None:
    """The server names requests itself; the client's X-Request-Id is only echoed back."""
    prompts = PROMPTS[:8]
    headers = {"X-Request-Id": "same-id-for-all"}

    def complete(prompt: str, stream: bool) -> tuple[str, str, str]:
        body = {"model": cluster.model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if stream:
            with cluster.client.stream("POST", "/v1/completions", json=body,
                                       headers=headers) as response:
                events = [e for e in sse_events(response) if isinstance(e, dict)]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            return text, events[0]["id"], response.headers["x-request-id"]
        response = cluster.client.post("/v1/completions", json=body, headers=headers)
        reply = response.json()
        return reply["choices"][0]["text"], reply["id"], response.headers["x-request-id"]

    jobs = [(p, i % 2 == 0) for p in prompts for i in range(2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(*job), jobs))
    for (prompt, _), (text, _, echoed) in zip(jobs, results, strict=True):
        expected = decode_text(tokenizer, reference(tokenizer.encode(prompt), 12),
                                    skip_special_tokens=True)
        assert text == expected and echoed == "same-id-for-all", prompt
    assert len({reply_id for _, reply_id, _ in results}) == len(jobs)


def test_chat_stream_and_whole_agree(cluster: Cluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = cluster.client.post("/v1/chat/completions", json=body).json()
    with cluster.client.stream("POST", "/v1/chat/completions",
                               json={**body, "stream": True}) as response:
        events = list(sse_events(response))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == whole["choices"][0]["message"]["content"]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]].count("length") == 1
    assert whole["object"] == "chat.completion"
    assert whole["usage"]["completion_tokens"] == 16
    assert events[-1] == "[DONE]"


def test_max_tokens_one_and_two_count_exactly(cluster: Cluster) -> None:
    for max_tokens in (1, 2):
        result = stream_completion(cluster, "Hello there", max_tokens)
        assert result["usage"]["completion_tokens"] == max_tokens
        assert result["finish"] == ["length"]


def test_stop_string_across_tokens_is_never_streamed(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference
) -> None:
    prompt = "Once upon a time"
    full = decode_text(tokenizer, reference(tokenizer.encode(prompt), 32), skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 4]  # likely spans a token boundary
    result = stream_completion(cluster, prompt, 32, stop=[stop])
    assert result["text"] == full[: full.index(stop)]
    assert result["finish"] == ["stop"]


@pytest.mark.parametrize("body", [
    b"", b"null", b"x", b"[]", b'{"model": "m", "messages": [', b"\xff\xfe",
    b'{"messages": []}', b'{"model": "MODEL", "messages": []}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "n": 0}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": 5}]}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}',
    b'{"model": "unknown", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], '
    b'"stop_token_ids": [18446744073709551616]}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], '
    b'"stop_token_ids": [49152]}',
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    cluster: Cluster, body: bytes
) -> None:
    response = cluster.client.post("/v1/chat/completions",
                                   content=body.replace(b"MODEL", cluster.model.encode()))
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert stream_completion(cluster, "still alive?", 2)["finish"] == ["length"]


def test_context_overflow_names_the_limits(cluster: Cluster) -> None:
    body = {"model": cluster.model, "prompt": "hi " * 100, "max_tokens": 5000}
    response = cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "2048" in response.json()["error"]["message"]


@pytest.mark.parametrize("length", [1023, 1024, 1025, 2046, 2047])
def test_prompts_up_to_the_context_s_edge_are_served_as_transformers_does(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Any, length: int
) -> None:
    """Prompts (token ids) a block short of, at and past a block boundary, and the longest
    the context (2048) leaves room for: greedy tokens as transformers', every one counted."""
    ids = torch.randint(3, 49_000, (length,), generator=torch.Generator().manual_seed(length))
    max_tokens = min(4, 2048 - length)
    body = {"model": cluster.model, "prompt": ids.tolist(), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    reply = cluster.client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    expected = reference(ids.tolist(), max_tokens)
    assert reply.json()["choices"][0]["text"] == decode_text(tokenizer, expected,
                                                             skip_special_tokens=True)
    assert reply.json()["usage"]["prompt_tokens"] == length
    too_long = cluster.client.post("/v1/completions", json={**body, "prompt": [*body["prompt"],
                                                                          *[5] * (2049 - length)]})
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_health_answers_while_a_huge_prompt_is_tokenized(cluster: Cluster) -> None:
    """Tokenizing a 4 MB prompt (then refused: far past the context) runs off the event loop:
    probes and other requests are answered meanwhile."""
    body = {"model": cluster.model, "prompt": "many words " * 400_000, "max_tokens": 1}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(cluster.client.post, "/v1/completions", json=body)
        waits = []
        while not refused.done():
            began = time.monotonic()
            assert cluster.client.get("/health").status_code == 200
            waits.append(time.monotonic() - began)
        assert refused.result().status_code == 400
    print(f"/health answered {len(waits)} times during the tokenization, slowest "
          f"{max(waits) * 1000:.0f} ms")
    assert len(waits) >= 3 and max(waits) < 0.5


def test_unknown_route_and_method(cluster: Cluster) -> None:
    assert cluster.client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert cluster.client.get("/v1/chat/completions").status_code == 405


def test_client_disconnect_frees_every_block(cluster: Cluster) -> None:
    body = {"model": cluster.model, "prompt": "Tell me a story", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    for _ in range(4):
        with httpx.Client(base_url=cluster.url, timeout=30) as client, \
                client.stream("POST", "/v1/completions", json=body) as response:
            for count, _line in enumerate(response.iter_lines()):
                if count > 10:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _idle(cluster):
        time.sleep(0.2)
    assert _idle(cluster)


def _idle(cluster: Cluster) -> bool:
    workers = ("decode-0", "decode-1")
    return (all(cluster.metric("raging_kv_blocks_used", f'worker="{w}"') == 0 for w in workers)
            and all(cluster.metric("raging_worker_running", f'worker="{w}"') == 0 for w in workers)
            and cluster.metric("raging_requests_inflight") == 0)


def test_health_and_models(cluster: Cluster) -> None:
    assert cluster.client.get("/health").json() == {"status": "ok", "prefill": 2, "decode": 2,
                                                    "stalled": [], "draining": []}
    models = cluster.client.get("/v1/models").json()
    assert models["data"][0]["id"] == cluster.model


def test_the_gateway_serves_without_torch(cluster: Cluster) -> None:
    """Workers load torch; the gateway, after serving chats and completions, has not (a
    structured-output request may bring it in, through xgrammar: none is sent here)."""
    stream_completion(cluster, "Once upon a time", 4)
    body = {"model": cluster.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]}
    assert cluster.client.post("/v1/chat/completions", json=body).status_code == 200
    maps = {name: Path(f"/proc/{pid}/maps").read_text() for name, pid in cluster.pids().items()}
    assert "libtorch" not in maps["gateway"]
    assert all("libtorch" in text for name, text in maps.items() if name != "gateway")


def test_a_worker_with_another_kv_layout_is_refused(
    cluster: Cluster, make_tiny_model, tmp_path: Path
) -> None:
    other = make_tiny_model(num_hidden_layers=3)
    control = f"ipc://{cluster.run_dir}/control.sock"
    worker = subprocess.run(
        [sys.executable, "-m", "decode", "--model", str(other), "--control-address", control,
         "--worker-id", "decode-intruder", "--set", "decode.num_kv_blocks=16",
         "--set", "internal.curve=true", "--set", f"internal.keys_dir={cluster.run_dir}/curve"],
        capture_output=True, text=True, timeout=120,
    )
    assert worker.returncode != 0
    assert "KV layout mismatch" in worker.stderr
    assert cluster.client.get("/health").json()["decode"] == 2


def test_launcher_stops_every_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    with launch(tmp_path / "run", tiny_model_dir, prefill=1, decode=1) as running:
        pids = running.pids()
        assert len(pids) == 3 and all(alive(pid) for pid in pids.values())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids.values())


# SIGKILL is noticed by the heartbeat timeout (3 s); SIGINT makes the worker say it leaves at
# once (SIGTERM would drain it: tests/e2e/test_scaling.py).
@pytest.mark.parametrize(("signum", "noticed_within_s"), [(signal.SIGKILL, 6), (signal.SIGINT, 2)])
def test_a_decode_worker_that_dies_ends_its_streams_with_an_error_event(
    tiny_model_dir: Path, tmp_path: Path, signum: int, noticed_within_s: float
) -> None:
    # --restarts 0: left alone, launch.sh would start the killed worker again (test_metrics.py),
    # and worker_wait_s 0: the gateway would hold its requests for that (test_worker_faults.py)
    config = {**TEST_CONFIG, "gateway": {**TEST_CONFIG["gateway"], "worker_wait_s": 0}}
    with launch(tmp_path / "run", tiny_model_dir, prefill=1, decode=1, config=config,
                flags=["--restarts", "0"]) as running:
        body = {"model": running.model, "prompt": "Tell me a story", "max_tokens": 1800,
                "ignore_eos": True, "stream": True}
        events: list[Any] = []
        with ThreadPoolExecutor(1) as pool, \
                running.client.stream("POST", "/v1/completions", json=body) as response:
            whole = pool.submit(running.client.post, "/v1/completions",
                                json={**body, "stream": False})
            for event in sse_events(response):
                events.append(event)
                if len(events) == 5:
                    while running.metric("raging_requests_inflight") < 2:  # both under way
                        time.sleep(0.01)
                    os.kill(running.pids()["decode-0"], signum)
                    signalled_at = time.monotonic()
            failed = whole.result(timeout=30)  # a whole reply being made when it died
        assert time.monotonic() - signalled_at < noticed_within_s
        assert failed.status_code == 503 and failed.headers["retry-after"] == "1"
        assert failed.json()["error"]["code"] == "generation_failed"
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert not any(e["choices"][0]["finish_reason"] for e in events[:-2])
        assert running.client.get("/health").json()["decode"] == 0
        retry = running.client.post("/v1/completions", json={**body, "stream": False})
        assert retry.status_code == 503 and retry.headers["retry-after"]
        if signum == signal.SIGINT:
            assert "decode-0 left" in running.log("gateway")


def test_a_crashed_gateway_is_restarted_and_the_workers_join_it_with_nothing_held(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL of the gateway mid-stream: its clients lose their connections, launch.sh starts
    it again, the workers register with the new one, and what they were computing for the
    lost requests is aborted (their tokens name requests the new gateway never had)."""
    with launch(tmp_path / "run", tiny_model_dir, prefill=1, decode=1) as running:
        body = {"model": running.model, "prompt": "Tell me a story", "max_tokens": 1800,
                "ignore_eos": True, "stream": True}
        old = running.pids()["gateway"]
        with pytest.raises(httpx.HTTPError), \
                running.client.stream("POST", "/v1/completions", json=body) as response:
            for count, _ in enumerate(sse_events(response)):
                if count == 5:
                    os.kill(old, signal.SIGKILL)
        wait_for(lambda: running.pids()["gateway"] != old, 30, "launch.sh to restart it")
        assert "restarting gateway (1 of 3)" in (running.run_dir / "launch.log").read_text()
        took = wait_for(lambda: health_status(running) == 200, 60, "the workers to register")
        reply = running.client.post("/v1/completions", json={**body, "stream": False,
                                                              "max_tokens": 8})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        wait_for(lambda: holds_nothing(running), 30, "the lost request's blocks")
        assert running.log("decode-0").count(": finished (") == 1  # the lost one was aborted
        assert alive(old) is False and running.launcher.poll() is None
        print(f"gateway restarted; workers registered {took:.1f} s after it was started again")


def health_status(cluster: Cluster) -> int:
    try:
        return cluster.client.get("/health").status_code
    except httpx.HTTPError:
        return 0  # not listening yet


def holds_nothing(cluster: Cluster) -> bool:
    """Whether both workers have reported (a heartbeat since they registered) holding no KV
    block and running no sequence."""
    try:
        return not any(cluster.metric(name, f'worker="{worker}"')
                       for worker in ("prefill-0", "decode-0")
                       for name in ("raging_kv_blocks_used", "raging_worker_running"))
    except KeyError:
        return False  # no heartbeat from one of them yet


def test_launcher_exits_non_zero_when_a_process_fails_to_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        launcher = subprocess.run(
            [str(ROOT / "scripts/launch.sh"), "--model", str(tiny_model_dir),
             "--run-dir", str(tmp_path / "run"), "--port", str(taken.getsockname()[1])],
            capture_output=True, text=True, timeout=120)
    assert launcher.returncode == 1
    assert "gateway exited during start-up" in launcher.stderr
    assert not any(alive(pid) for pid in started_pids(tmp_path / "run").values())


def test_a_tiny_decode_pool_preempts_and_resumes_without_dropping(
    tiny_model_dir: Path, tmp_path: Path, tokenizer: PreTrainedTokenizerBase, reference
) -> None:
    config = {**TEST_CONFIG, "decode": {**TEST_CONFIG["decode"], "num_kv_blocks": 24}}
    prompts = [f"Story {i}: once upon a time" for i in range(8)]
    max_tokens = 150  # 8 sequences of ~170 tokens need ~88 blocks of 16; the pool has 24
    with launch(tmp_path / "run", tiny_model_dir, config=config) as running:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: stream_completion(running, p, max_tokens), prompts))
        wait_for(lambda: running.metric("raging_kv_blocks_used", 'worker="decode-0"') == 0
                 and running.metric("raging_worker_preemptions_total", 'worker="decode-0"') > 0,
                 2.0, "a heartbeat with the preemptions and no block held")
    for prompt, result in zip(prompts, results, strict=True):
        expected = reference(tokenizer.encode(prompt), max_tokens)
        assert result["text"] == decode_text(tokenizer, expected, skip_special_tokens=True)
        assert result["usage"]["completion_tokens"] == max_tokens


def _post_raw(cluster: Cluster, headers: str, body: Iterator[bytes]) -> bytes:
    """Send a request over a plain socket, body piece by piece until the server stops reading;
    what it answered."""
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        raw.settimeout(2)
        for piece in body:
            try:
                raw.sendall(piece)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                break  # it stopped reading: the answer is waiting
        raw.settimeout(10)
        answer = raw.recv(4096)
        raw.settimeout(1)
        while b"payload_too_large" not in answer and len(answer) < 4096:
            try:
                more = raw.recv(4096)
            except TimeoutError:
                break
            if not more:
                break
            answer += more
        return answer


def test_a_200_mb_body_gets_413_without_being_buffered(cluster: Cluster) -> None:
    gateway = psutil.Process(cluster.pids()["gateway"])
    before = gateway.memory_info().rss
    mb = b"x" * 2**20
    declared = _post_raw(cluster, f"Content-Length: {200 * 2**20}\r\n", iter([mb] * 200))
    chunked = _post_raw(cluster, "Transfer-Encoding: chunked\r\n",
                        (b"%x\r\n%s\r\n" % (len(mb), mb) for _ in range(200)))
    for answer in (declared, chunked):
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"code":"payload_too_large"' in answer.replace(b" ", b"")
    assert gateway.memory_info().rss - before < 64 * 2**20  # the 16 MB limit, not 200 MB
    assert stream_completion(cluster, "still alive?", 2)["finish"] == ["length"]


def test_cached_tokens_are_reported_truthfully(cluster: Cluster, tokenizer, reference) -> None:
    """A cold prompt reports 0 cached tokens; the same 40-token prefix again reports its full
    blocks (routed to the prefill worker that has them), never more than the prompt, and the
    output is the same as cold."""
    prefix = [200 + i for i in range(40)]

    def usage_and_text(prompt: list[int]) -> tuple[dict, str]:
        body = {"model": cluster.model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        reply = cluster.client.post("/v1/completions", json=body).json()
        return reply["usage"], reply["choices"][0]["text"]

    cold_usage, cold_text = usage_and_text([*prefix, 1, 2])
    assert cold_usage["prompt_tokens_details"] == {"cached_tokens": 0}
    for _ in range(3):  # whichever of the 2 prefill workers, the router goes back to it
        warm_usage, warm_text = usage_and_text([*prefix, 1, 2])
        assert warm_usage["prompt_tokens_details"] == {"cached_tokens": 32}
        assert warm_text == cold_text
    short = [*prefix[:16]]  # one exact block: its last token is computed, so nothing cached
    assert usage_and_text(short)[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    expected = decode_text(tokenizer, reference([*prefix, 1, 2], 6), skip_special_tokens=True)
    assert cold_text == expected


def read_response(conn: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body (it may come in pieces)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(4096)
        if not piece:
            return data  # closed by the server
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(4096)
    return head + b"\r\n\r\n" + body


def test_an_idle_connection_outlives_the_clients_pool(cluster: Cluster) -> None:
    """A second request on a connection idle for 6 s, longer than the 5 s that httpx and the
    openai client keep one, is answered: the server has not closed it under the client."""
    port = int(cluster.url.rsplit(":", 1)[1])
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        for pause_s in (0, 6):
            time.sleep(pause_s)
            conn.sendall(request)
            assert read_response(conn).startswith(b"HTTP/1.1 200"), f"after {pause_s} s idle"
