"""One cache across the cluster, end to end on a tiny random Llama: a chat's next turn sent on
purpose to the decode worker that does not hold its history (`history_routing: spread`) pulls
the history's KV from the one that does, over the KV channel, and prefills only the rest;
greedy output as transformers'; a holder that does not answer (SIGSTOP) costs a lease, and
the prompt is computed instead."""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, with_decode_cache

pytestmark = pytest.mark.e2e

PULL_LEASE_S = 1.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    config: dict[str, Any] = copy.deepcopy(with_decode_cache(TEST_CONFIG))
    # Always: on the tiny model computing a prefix takes about as long as pulling it.
    config["gateway"].update({"history_routing": "spread", "pull_min_tokens": 16,
                              "pull_prefixes": "always"})
    config["kv_transfer"] = {"pull_lease_s": PULL_LEASE_S}
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config,
                flags=["--colocated", "2"]) as running:
        yield running


def complete(cluster: Cluster, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    response = cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def pulls(cluster: Cluster, outcome: str) -> float:
    return sum(cluster.metric("raging_kv_pulls_total", f'outcome="{outcome}",worker="{w}"')
               for w in ("decode-0", "decode-1"))


def two_turns(cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference,
              topic: str) -> tuple[dict[str, Any], list[int], int]:
    """Turn 1, then turn 2 (turn 1's prompt and answer, then more): turn 2's reply, prompt,
    and the tokens of the history whose KV turn 1 left cached."""
    first = tokenizer.encode(f"A chat about {topic}, which goes on for a while. " * 3)
    answer = reference(first, 20)
    assert complete(cluster, first, 20)["choices"][0]["text"] == decode_text(
        tokenizer, answer, skip_special_tokens=True)
    second = [*first, *answer, *tokenizer.encode(" Tell me more.")]
    held = (len(first) + len(answer) - 1) // 16 * 16  # the answer's last token never fed
    return complete(cluster, second, 12), second, held


def test_a_turn_away_from_its_history_pulls_it_and_computes_only_the_rest(
        cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference) -> None:
    pulled, fallbacks = pulls(cluster, "pulled"), pulls(cluster, "fallback")
    local = cluster.metric("raging_disagg_decision_total", 'path="local_cached"')
    reply, second, held = two_turns(cluster, tokenizer, reference, "rivers")
    expected = decode_text(tokenizer, reference(second, 12), skip_special_tokens=True)
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert cluster.metric("raging_disagg_decision_total", 'path="local_cached"') == local + 1
    assert cluster.metric("raging_kv_pulls_routed_total", 'holder_role="decode"') >= 1
    deadline = time.monotonic() + 5  # heartbeats bring the decode workers' counts
    while pulls(cluster, "pulled") == pulled and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pulls(cluster, "pulled") == pulled + 1 and pulls(cluster, "fallback") == fallbacks
    assert sum(cluster.metric("raging_kv_pull_tokens_total", f'worker="{w}"')
               for w in ("decode-0", "decode-1")) >= held


def test_a_holder_that_does_not_answer_costs_a_lease_and_the_prompt_is_computed(
        cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference) -> None:
    first = tokenizer.encode("A chat about trains, which goes on for a while. " * 3)
    answer = reference(first, 20)
    finished = finishes(cluster)
    complete(cluster, first, 20)
    (holder,) = [w for w, n in finishes(cluster).items() if n > finished[w]]
    second = [*first, *answer, *tokenizer.encode(" Tell me more.")]
    fallbacks = pulls(cluster, "fallback")
    pid = cluster.pids()[holder]
    os.kill(pid, signal.SIGSTOP)  # it gets the pull and cannot answer
    try:
        started = time.monotonic()
        reply = complete(cluster, second, 12)
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    expected = decode_text(tokenizer, reference(second, 12), skip_special_tokens=True)
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert took >= PULL_LEASE_S
    deadline = time.monotonic() + 10  # the stopped holder's heartbeats resume first
    while pulls(cluster, "fallback") == fallbacks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pulls(cluster, "fallback") == fallbacks + 1


def finishes(cluster: Cluster) -> dict[str, int]:
    """Requests each decode worker's log says it finished."""
    return {worker: (cluster.run_dir / f"{worker}.log").read_text().count(": finished (")
            for worker in ("decode-0", "decode-1")}
