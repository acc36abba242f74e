"""Work on the decode worker, end to end on a tiny random Llama: prefill in colocated mode
(`launch.sh --colocated 2`) and under conditional disaggregation (short prompts stay on
decode), n > 1 choices forked from one prefill, on either path, embeddings on either path,
and a chat's next turn prefilled where its history is cached."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import TEST_CONFIG, Cluster, launch, sse_events, with_decode_cache
from tests.reference import last_hidden_state

pytestmark = pytest.mark.e2e

SHORT = ["Hello", "A", "Roses are red,", "Le chat est"]  # 8 tokens or fewer
KEYS = {"alpha": "sk-alpha-0123456789", "beta": "sk-beta-0123456789"}  # `disaggregated`'s
LONG = ["The quick brown fox jumps over the lazy dog " * 4, "Once upon a time, " * 9,
        "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3]


def config(decode_cache: bool = True, **gateway: int) -> dict[str, Any]:
    """Chunks of 16 tokens, so that every long prompt is prefilled in several."""
    settings = copy.deepcopy(with_decode_cache(TEST_CONFIG) if decode_cache else TEST_CONFIG)
    settings["gateway"].update(gateway)
    settings["decode"]["chunk_tokens"] = 16
    return settings


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, config=config(),
                flags=["--colocated", "2"]) as running:
        yield running


@pytest.fixture(scope="module")
def conditional(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Cluster]:
    """Routing by prompt length alone: with its cache on, the decode worker would take the
    LONG prompts sent again by later tests (`disaggregated` below has it on)."""
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, prefill=1, decode=1,
                config=config(decode_cache=False, local_prefill_max_tokens=8)) as running:
        yield running


@pytest.fixture(scope="module")
def disaggregated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Cluster]:
    flags = [arg for tenant, key in KEYS.items() for arg in ("--api-key", f"{key}:{tenant}")]
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir, prefill=1, decode=1,
                config=config(), flags=flags, api_key=KEYS["alpha"]) as running:
        yield running


def complete(cluster: Cluster, prompt: str | list[int], max_tokens: int, tenant: str = "",
             **extra: Any) -> dict[str, Any]:
    """A completion, as `tenant` (by its key) or as the cluster's client."""
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, **extra}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else None
    response = cluster.client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def decisions(cluster: Cluster) -> dict[str, float]:
    paths = ("disaggregated", "local_short", "local_saturated", "local_no_prefill",
             "local_cached")
    return {p: cluster.metric("raging_disagg_decision_total", f'path="{p}"') for p in paths}


def test_colocated_workers_serve_greedy_streams_equal_to_transformers(
        colocated: Cluster, tokenizer: PreTrainedTokenizerBase, reference) -> None:
    prompts = (SHORT + LONG) * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: complete(colocated, p, 16, temperature=0), prompts))
    for prompt, reply in zip(prompts, replies, strict=True):
        ids = tokenizer.encode(prompt)
        expected = decode_text(tokenizer, reference(ids, 16), skip_special_tokens=True)
        assert reply["choices"][0]["text"] == expected, prompt
        assert reply["usage"]["prompt_tokens"] == len(ids)
    routed = decisions(colocated)
    assert routed["local_no_prefill"] + routed["local_cached"] >= len(prompts)
    assert colocated.metric("raging_workers", 'role="prefill"') == 0
    for worker in ("decode-0", "decode-1"):
        assert settles_to_zero(colocated, "raging_worker_running", worker)
        assert settles_to_zero(colocated, "raging_kv_blocks_used", worker)


def test_conditional_keeps_short_prompts_on_decode_and_sends_long_ones_to_prefill(
        conditional: Cluster, tokenizer: PreTrainedTokenizerBase, reference) -> None:
    before = decisions(conditional)
    assert all(len(tokenizer.encode(p)) <= 8 < len(tokenizer.encode(q))
               for p in SHORT for q in LONG)
    for prompt in SHORT + LONG:
        reply = complete(conditional, prompt, 8, temperature=0, logprobs=2)
        expected = decode_text(tokenizer, reference(tokenizer.encode(prompt), 8),
                                    skip_special_tokens=True)
        choice = choice_of(reply)
        assert choice["text"] == expected, prompt
        assert len(choice["logprobs"]["tokens"]) == 8  # the first token's too, either path
    after = decisions(conditional)
    assert after["local_short"] - before["local_short"] == len(SHORT)
    assert after["disaggregated"] - before["disaggregated"] == len(LONG)


def test_embeddings_are_the_same_on_either_path(colocated: Cluster, conditional: Cluster,
                                                tokenizer: PreTrainedTokenizerBase,
                                                tiny_model_dir: Path) -> None:
    """Short inputs stay on decode and long ones go to prefill under conditional routing;
    every decode worker prefills them in colocated mode (LONG ones in chunks): the same
    vectors, transformers' own."""
    before = decisions(conditional)
    vectors = []
    for cluster in (conditional, colocated):
        reply = cluster.client.post("/v1/embeddings", json={"input": SHORT + LONG,
                                                            "normalize": False})
        assert reply.status_code == 200, reply.text
        vectors.append(torch.tensor([item["embedding"] for item in reply.json()["data"]]))
    after = decisions(conditional)
    assert after["local_short"] - before["local_short"] == len(SHORT)
    assert after["disaggregated"] - before["disaggregated"] == len(LONG)
    expected = torch.stack([last_hidden_state(tiny_model_dir, tokenizer.encode(text))
                            for text in SHORT + LONG])
    for got in vectors:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def settles_to_zero(cluster: Cluster, metric: str, worker: str, within_s: float = 5) -> bool:
    """Whether the worker's gauge reads 0 within the time (heartbeats bring it)."""
    deadline = time.monotonic() + within_s
    while cluster.metric(metric, f'worker="{worker}"') and time.monotonic() < deadline:
        time.sleep(0.2)
    return cluster.metric(metric, f'worker="{worker}"') == 0


def choice_of(reply: dict[str, Any]) -> dict[str, Any]:
    (choice,) = reply["choices"]
    return choice


def test_seeded_sampling_is_the_same_on_either_path(
        colocated: Cluster, conditional: Cluster) -> None:
    """A long prompt is prefilled by a prefill worker in one cluster and by the decode worker
    in the other: with the same seed, the same text."""
    before = decisions(conditional)["disaggregated"]
    for seed, prompt in enumerate(LONG):
        texts = [choice_of(complete(c, prompt, 12, temperature=1.0, seed=seed))["text"]
                 for c in (conditional, colocated)]
        assert texts[0] == texts[1], prompt
    assert decisions(conditional)["disaggregated"] - before == len(LONG)


@pytest.mark.parametrize("path", ["disaggregated", "colocated"])
def test_n_choices_are_each_what_a_lone_request_with_its_seed_gives(
        path: str, colocated: Cluster, conditional: Cluster,
        tokenizer: PreTrainedTokenizerBase) -> None:
    """Choice i of a request seeded s equals a lone request seeded s + i: each choice has
    its own sampler over the one prefilled prompt, forked on decode."""
    cluster = conditional if path == "disaggregated" else colocated
    prompt, before = LONG[0], decisions(cluster)
    reply = complete(cluster, prompt, 10, temperature=1.0, seed=40, n=3)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in reply["choices"]]
    alone = [choice_of(complete(cluster, prompt, 10, temperature=1.0, seed=40 + i))["text"]
             for i in range(3)]
    assert texts == alone and len(set(texts)) == 3
    assert reply["usage"]["completion_tokens"] == 30  # the prompt counts once
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert sum(decisions(cluster).values()) - sum(before.values()) == 1 + 3  # routed once


def test_n_choices_stream_with_their_index(colocated: Cluster, tokenizer, reference) -> None:
    body = {"model": colocated.model, "prompt": LONG[1], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "n": 4, "stream": True, "stream_options": {"include_usage": True}}
    with colocated.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 32
    texts = ["", "", "", ""]
    finished = []
    for event in events[:-2]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.append(choice["index"])
    expected = decode_text(tokenizer, reference(tokenizer.encode(LONG[1]), 8),
                           skip_special_tokens=True)
    assert texts == [expected] * 4 and sorted(finished) == [0, 1, 2, 3]


def test_n_choices_through_the_openai_client(conditional: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{conditional.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=conditional.model, messages=[{"role": "user", "content": LONG[2]}], n=2,
        max_tokens=6, temperature=0.8, seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert settles_to_zero(conditional, "raging_kv_blocks_used", "decode-0")


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_a_chats_next_turn_is_prefilled_where_its_history_is_cached(
        layout: str, colocated: Cluster, disaggregated: Cluster,
        tokenizer: PreTrainedTokenizerBase, reference) -> None:
    """Turn 2 (turn 1's prompt and answer, then a new message) goes to the decode worker that
    generated turn 1, which computes only what it does not hold: greedy output as
    transformers', and usage counts the history's full blocks cached."""
    cluster = disaggregated if layout == "disaggregated" else colocated
    first = tokenizer.encode(f"A chat on the {layout} path. " + LONG[0])
    answer = reference(first, 20)
    turn_1 = complete(cluster, first, 20, temperature=0)
    assert choice_of(turn_1)["text"] == decode_text(tokenizer, answer, skip_special_tokens=True)
    before = decisions(cluster)
    second = [*first, *answer, *tokenizer.encode(" And then what happened?")]
    turn_2 = complete(cluster, second, 12, temperature=0)
    expected = decode_text(tokenizer, reference(second, 12), skip_special_tokens=True)
    assert choice_of(turn_2)["text"] == expected
    held = (len(first) + len(answer) - 1) // 16 * 16  # the answer's last token was never fed
    assert turn_2["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    after = decisions(cluster)
    assert after["local_cached"] - before["local_cached"] == 1
    assert sum(after.values()) - sum(before.values()) == 1


def test_a_next_turn_finds_only_its_own_tenants_history_on_decode(
        disaggregated: Cluster, tokenizer: PreTrainedTokenizerBase, reference) -> None:
    first = tokenizer.encode("A chat only alpha has had. " + LONG[1])
    answer = reference(first, 20)
    complete(disaggregated, first, 20, "alpha", temperature=0)
    second = [*first, *answer, *tokenizer.encode(" Go on.")]
    before = decisions(disaggregated)
    beta = complete(disaggregated, second, 4, "beta", temperature=0)
    assert beta["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = decisions(disaggregated)
    assert after["disaggregated"] == before["disaggregated"] + 1  # nothing of alpha's matched
    alpha = complete(disaggregated, second, 4, "alpha", temperature=0)
    assert alpha["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        len(first) + len(answer) - 1) // 16 * 16
    assert decisions(disaggregated)["local_cached"] == after["local_cached"] + 1
    assert alpha["choices"][0]["text"] == beta["choices"][0]["text"]  # one model, one answer
