"""Per-stage latency and traces, end to end on a tiny random Llama under conditional
disaggregation (short prompts are prefilled on the decode worker, long ones by the prefill
worker): the stage histograms and the per-request breakdown, read with the official openai
client; spans from every process, exported to an OTLP/HTTP receiver on loopback, in one trace
per request; and no opentelemetry at all in any process when no endpoint is set."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from core.messages import STAGES
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch
from tests.e2e.otlp import ReceivedSpan, Receiver, otlp_receiver

pytestmark = pytest.mark.e2e

SHORT = "Hello"  # prefilled on the decode worker
LONG = "The quick brown fox jumps over the lazy dog " * 4  # prefilled by the prefill worker
MAX_TOKENS = 4
SLACK_MS = 2.0  # the breakdown's rounding, and nothing else: every stamp is on one host
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
DISAGGREGATED_SPANS = {
    ("raging-gateway", "POST /v1/completions"), ("raging-gateway", "gateway.queue"),
    ("raging-prefill", "prefill.queue"), ("raging-prefill", "prefill.compute"),
    ("raging-decode", "kv.transfer"), ("raging-decode", "decode.generation"),
    ("raging-decode", "decode.first_step"),
}
LOCAL_SPANS = {
    ("raging-gateway", "POST /v1/completions"), ("raging-gateway", "gateway.queue"),
    ("raging-decode", "prefill.queue"), ("raging-decode", "prefill.compute"),
    ("raging-decode", "decode.generation"), ("raging-decode", "decode.first_step"),
}


def config() -> dict[str, Any]:
    settings = copy.deepcopy(TEST_CONFIG)
    settings["gateway"]["local_prefill_max_tokens"] = 8
    return settings


@pytest.fixture(scope="module")
def untraced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Cluster]:
    """A cluster without an endpoint whose every Python process logs each module it imports
    (PYTHONPROFILEIMPORTTIME), so that a test can tell what was never imported."""
    with ExitStack() as stack:
        env = stack.enter_context(pytest.MonkeyPatch.context())
        env.setenv("PYTHONPROFILEIMPORTTIME", "1")
        cluster = stack.enter_context(launch(tmp_path_factory.mktemp("run"), tiny_model_dir,
                                             config=config()))
        env.undo()  # the processes have started: nothing else started later inherits it
        yield cluster


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Cluster, Receiver]]:
    with otlp_receiver() as receiver, launch(
            tmp_path_factory.mktemp("run"), tiny_model_dir, config=config(),
            flags=["--otlp-endpoint", receiver.url]) as cluster:
        yield cluster, receiver


def openai_client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120,
                         max_retries=0)


def stage_counts(cluster: Cluster) -> dict[str, float]:
    return {stage: cluster.metric("raging_stage_seconds_count", f'stage="{stage}"')
            for stage in STAGES}


def check_breakdown(timing: dict[str, Any], handed_off: bool) -> None:
    """Every stage of the request's path is there and non-negative, the transfer only where
    its KV moved; the stages before the first token fit in its TTFT, and with the first decode
    step (after the KV is whole, so never overlapping them) in the whole request."""
    stages = {stage: timing[f"{stage}_ms"] for stage in STAGES}
    assert (stages["kv_transfer"] is not None) == handed_off, timing
    assert all(v >= 0 for v in stages.values() if v is not None), timing
    assert all(stages[s] is not None for s in STAGES if s != "kv_transfer"), timing
    before_first = stages["gateway_queue"] + stages["prefill_wait"] + stages["prefill_compute"]
    assert before_first <= timing["ttft_ms"] + SLACK_MS, timing
    assert before_first + stages["first_decode"] <= timing["e2e_ms"] + SLACK_MS, timing
    assert timing["ttft_ms"] <= timing["e2e_ms"] and timing["resumed"] == 0, timing


def test_stage_histograms_count_each_stage_of_each_request(untraced: Cluster) -> None:
    """3 prompts handed off, 2 prefilled on decode, streamed or not: every stage observed once
    per request, kv_transfer only for the ones handed off (a request resumed on a loaded
    machine, its messages late, may add its new epoch's worker stages)."""
    client = openai_client(untraced)
    before = stage_counts(untraced)
    resumed_before = untraced.metric("raging_requests_resumed_total")
    for prompt, stream in ((LONG, False), (LONG, True), (LONG, False), (SHORT, True),
                           (SHORT, False)):
        if stream:
            chunks = list(client.completions.create(
                model=untraced.model, prompt=prompt, stream=True, max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True}))
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            whole = client.completions.create(
                model=untraced.model, prompt=prompt, max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True})
            assert whole.choices[0].finish_reason == "length"
    after = stage_counts(untraced)
    resumes = untraced.metric("raging_requests_resumed_total") - resumed_before
    grown = {stage: after[stage] - before[stage] for stage in STAGES}
    expected = {"gateway_queue": 5, "prefill_wait": 5, "prefill_compute": 5, "kv_transfer": 3,
                "first_decode": 5}
    assert grown["gateway_queue"] == 5, grown  # queued once, whatever happens after
    assert all(expected[s] <= grown[s] <= expected[s] + resumes for s in STAGES), grown
    assert untraced.metric("raging_stage_seconds_sum", 'stage="prefill_compute"') > 0


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_a_whole_response_carries_its_breakdown_when_the_body_asks(untraced: Cluster,
                                                                   prompt: str) -> None:
    client = openai_client(untraced)
    asked = client.completions.create(
        model=untraced.model, prompt=prompt, max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True, "raging": {"timing": True}})
    assert asked.model_extra is not None
    check_breakdown(asked.model_extra["raging"]["timing"], handed_off=prompt == LONG)
    plain = client.completions.create(model=untraced.model, prompt=prompt,
                                      max_tokens=MAX_TOKENS)
    assert "raging" not in (plain.model_extra or {})  # only when asked


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_a_stream_carries_its_breakdown_in_its_last_chunk_when_the_header_asks(
        untraced: Cluster, prompt: str) -> None:
    client = openai_client(untraced)
    sent = time.monotonic()
    first_chunk_at = None  # a chunk comes once there is text (or the end): after the first token
    chunks = []
    for chunk in client.completions.create(
            model=untraced.model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Raging-Timing": "true"}):
        if first_chunk_at is None and chunk.choices:
            first_chunk_at = time.monotonic()
        chunks.append(chunk)
    carrying = [c for c in chunks if "raging" in (c.model_extra or {})]
    assert len(carrying) == 1 and carrying[0].choices[0].finish_reason == "length"
    assert carrying[0].model_extra is not None
    timing = carrying[0].model_extra["raging"]["timing"]
    check_breakdown(timing, handed_off=prompt == LONG)
    assert first_chunk_at is not None
    assert timing["ttft_ms"] <= (first_chunk_at - sent) * 1000 + SLACK_MS  # the client's TTFT


def test_chat_carries_the_breakdown_too(untraced: Cluster) -> None:
    reply = openai_client(untraced).chat.completions.create(
        model=untraced.model, messages=[{"role": "user", "content": LONG}],
        max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "raging": {"timing": True}})
    assert reply.model_extra is not None
    check_breakdown(reply.model_extra["raging"]["timing"], handed_off=True)


def test_each_choice_ends_with_its_own_breakdown(untraced: Cluster) -> None:
    """n = 2: the prompt is prefilled once; the second choice is forked on decode."""
    chunks = list(openai_client(untraced).completions.create(
        model=untraced.model, prompt=LONG, max_tokens=MAX_TOKENS, n=2, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"X-Raging-Timing": "true"}))
    ends: dict[int, Any] = {c.choices[0].index: (c.model_extra or {}).get("raging")
                            for c in chunks if c.choices and c.choices[0].finish_reason}
    assert set(ends) == {0, 1} and all(end is not None for end in ends.values())
    first, forked = ends[0]["timing"], ends[1]["timing"]
    check_breakdown(first, handed_off=True)
    assert forked["prefill_compute_ms"] is None and forked["first_decode_ms"] >= 0
    assert forked["gateway_queue_ms"] == first["gateway_queue_ms"]


def test_without_an_endpoint_no_process_imports_opentelemetry(untraced: Cluster) -> None:
    for prompt in (LONG, SHORT):
        response = untraced.client.post("/v1/completions", json={
            "model": untraced.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "raging": {"timing": True}})
        assert response.status_code == 200, response.text
    for process in ("gateway", "prefill-0", "decode-0"):
        log = untraced.log(process)
        assert "import time:" in log and "core.tracing" in log  # every import is logged
        assert "opentelemetry" not in log, process


def spans_of(spans: list[ReceivedSpan], request_id: str) -> dict[tuple[str, str], ReceivedSpan]:
    """The request's spans by (service, name): each one exactly once."""
    mine = [s for s in spans if s.attributes.get("raging.request_id") == request_id]
    by_name = {(s.service, s.name): s for s in mine}
    assert len(by_name) == len(mine), mine
    return by_name


def traced_request(cluster: Cluster, receiver: Receiver, prompt: str, expected: set[Any],
                   headers: dict[str, str] | None = None) -> dict[tuple[str, str], ReceivedSpan]:
    response = cluster.client.post("/v1/completions", headers=headers or {}, json={
        "model": cluster.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    assert response.status_code == 200, response.text
    request_id = response.json()["id"].removeprefix("cmpl-")
    receiver.wait_for(lambda spans: set(spans_of(spans, request_id)) >= expected,
                      f"spans of {request_id}")
    time.sleep(1.5)  # a span exported late, twice, or one too many would be here by now
    spans = spans_of(receiver.spans, request_id)
    assert set(spans) == expected
    return spans


def check_tree(spans: dict[tuple[str, str], ReceivedSpan], parent_of_root: str) -> None:
    """One trace; the gateway's span under the client's (if any), every other span under it,
    but decode.first_step, under decode.generation."""
    root = spans[("raging-gateway", "POST /v1/completions")]
    generation = spans[("raging-decode", "decode.generation")]
    assert {s.trace_id for s in spans.values()} == {root.trace_id}
    assert root.parent_id == parent_of_root
    for (service, name), span in spans.items():
        if name == "decode.first_step":
            assert span.parent_id == generation.span_id
            assert generation.start_ns <= span.start_ns <= span.end_ns <= generation.end_ns
        elif span is not root:
            assert span.parent_id == root.span_id, (service, name)
        assert span.start_ns <= span.end_ns


def test_a_handed_off_request_is_one_trace_under_the_clients_traceparent(
        traced: tuple[Cluster, Receiver]) -> None:
    cluster, receiver = traced
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    spans = traced_request(cluster, receiver, LONG, DISAGGREGATED_SPANS,
                           {"traceparent": traceparent})
    check_tree(spans, CLIENT_SPAN)
    assert spans[("raging-gateway", "POST /v1/completions")].trace_id == CLIENT_TRACE
    queue, compute = spans[("raging-prefill", "prefill.queue")], spans[
        ("raging-prefill", "prefill.compute")]
    assert queue.end_ns == compute.start_ns  # one stamp: the first chunk's forward pass began
    assert compute.attributes["raging.worker_id"] == "prefill-0"
    assert compute.attributes["raging.decode_worker"] == "decode-0"
    generation = spans[("raging-decode", "decode.generation")]
    assert generation.attributes["raging.worker_id"] == "decode-0"
    assert generation.attributes["raging.output_tokens"] == MAX_TOKENS
    assert generation.attributes["raging.finish_reason"] == "length"
    root = spans[("raging-gateway", "POST /v1/completions")]
    assert root.attributes["raging.output_tokens"] == MAX_TOKENS
    assert root.attributes["raging.prompt_tokens"] == compute.attributes["raging.prompt_tokens"]
    assert root.attributes["raging.outcome"] == "ok"


def test_requests_without_a_traceparent_each_start_a_trace_of_their_own(
        traced: tuple[Cluster, Receiver]) -> None:
    """Prefilled on the decode worker: its prefill spans come from there, with no transfer."""
    cluster, receiver = traced
    first = traced_request(cluster, receiver, SHORT, LOCAL_SPANS)
    second = traced_request(cluster, receiver, SHORT, LOCAL_SPANS)
    for spans in (first, second):
        check_tree(spans, "")
        compute = spans[("raging-decode", "prefill.compute")]
        assert compute.attributes["raging.worker_id"] == "decode-0"
    trace_ids = {spans[("raging-gateway", "POST /v1/completions")].trace_id
                 for spans in (first, second)}
    assert len(trace_ids) == 2 and CLIENT_TRACE not in trace_ids


def test_an_embedding_request_is_one_trace_over_each_inputs_prefill(
        traced: tuple[Cluster, Receiver]) -> None:
    """Two inputs, each a request of its own to the prefill worker, under the gateway's span,
    itself under the client's."""
    cluster, receiver = traced
    response = cluster.client.post("/v1/embeddings", json={"input": [LONG, LONG + "again"]},
                                   headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert response.status_code == 200, response.text

    def mine(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        """The embedding's span (the only one of that name) and its children."""
        roots = {s.span_id for s in spans if s.name == "POST /v1/embeddings"}
        return [s for s in spans if s.span_id in roots or s.parent_id in roots]

    receiver.wait_for(lambda spans: len(mine(spans)) >= 3, "the embedding's spans")
    time.sleep(1.5)  # a span exported late, twice, or one too many would be here by now
    spans = mine(receiver.spans)
    (root,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    children = [s for s in spans if s is not root]
    assert root.trace_id == CLIENT_TRACE and root.parent_id == CLIENT_SPAN
    assert root.attributes["raging.outcome"] == "ok" and root.attributes["raging.inputs"] == 2
    computes = [s for s in children if s.name == "prefill.compute"]
    assert len(computes) == 2 and {s.service for s in computes} == {"raging-prefill"}
    assert {s.name for s in children} == {"prefill.queue", "prefill.compute"}, children
    assert root.attributes["raging.request_id"] in {
        s.attributes["raging.request_id"] for s in computes}
    assert sum(s.attributes["raging.prompt_tokens"] for s in computes) == \
        root.attributes["raging.prompt_tokens"]
