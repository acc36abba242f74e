"""llama.cpp's native API end to end on the real SmolLM2-135M-Instruct, as a client written
against its server calls it with plain HTTP: `/completion` whole and streamed (the same greedy
text as /v1/completions), what ended it (a limit, a stopping word, EOS under a GBNF grammar),
its token probabilities, a banned token, `/props`, and a stream left early freeing its KV
blocks. 1 gateway + 1 prefill + 1 decode."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]
CLUSTER_CONTEXT = 1024  # the tests that fill it prefill 1,024 tokens, not 4,096

PROMPT = "The capital of France is"


def complete(cluster: Cluster, **fields: Any) -> dict[str, Any]:
    reply = cluster.client.post("/completion", json={"prompt": PROMPT, "temperature": 0,
                                                     **fields})
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def streamed(cluster: Cluster, **fields: Any) -> list[dict[str, Any]]:
    """Every object of a streamed /completion; it ends with the last, never with [DONE]."""
    body = {"prompt": PROMPT, "temperature": 0, "stream": True, **fields}
    with cluster.client.stream("POST", "/completion", json=body) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def test_a_greedy_completion_is_the_openai_route_s(cluster: Cluster) -> None:
    whole = complete(cluster, n_predict=12)
    openai = cluster.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    assert whole["content"] == openai["choices"][0]["text"]
    assert (whole["stop"], whole["stop_type"], whole["tokens_predicted"]) == (True, "limit", 12)
    assert whole["tokens_evaluated"] == openai["usage"]["prompt_tokens"]
    assert whole["prompt"] == PROMPT and whole["generation_settings"]["temperature"] == 0
    timings = whole["timings"]
    assert timings["predicted_n"] == 12 and timings["predicted_ms"] > 0
    assert timings["prompt_n"] + whole["tokens_cached"] == whole["tokens_evaluated"]


def test_the_stream_adds_up_to_the_whole(cluster: Cluster) -> None:
    pieces = streamed(cluster, n_predict=12)
    *text, last = pieces
    assert not any(piece["stop"] for piece in text) and last["stop"]
    whole = complete(cluster, n_predict=12, return_tokens=True)
    assert "".join(piece["content"] for piece in pieces) == whole["content"]
    assert [token for piece in pieces for token in piece["tokens"]] == whole["tokens"]
    assert len(whole["tokens"]) == 12 and complete(cluster, n_predict=12)["tokens"] == []
    assert (last["stop_type"], last["tokens_predicted"]) == ("limit", 12)
    assert [piece["tokens_predicted"] for piece in text] == list(range(1, len(text) + 1))


def test_several_prompts_are_completed_each_as_alone(cluster: Cluster) -> None:
    """llama.cpp's array of prompts: an array of results whole, each by its `index`; each
    prompt's objects and summary streamed under its index."""
    prompts: list[Any] = [PROMPT, "Once upon a time", [1, 504, 3458]]
    alone = [complete(cluster, prompt=prompt, n_predict=6) for prompt in prompts]
    reply = cluster.client.post("/completion", json={"prompt": prompts, "n_predict": 6,
                                                     "temperature": 0})
    together: list[dict[str, Any]] = reply.json()
    assert [result["index"] for result in together] == [0, 1, 2]
    assert [result["content"] for result in together] == [r["content"] for r in alone]
    assert [result["prompt"] for result in together] == [r["prompt"] for r in alone]
    pieces = streamed(cluster, prompt=prompts, n_predict=6)
    for index, whole in enumerate(alone):
        mine = [piece for piece in pieces if piece["index"] == index]
        assert "".join(piece["content"] for piece in mine) == whole["content"]
        assert [piece["stop"] for piece in mine] == [False] * (len(mine) - 1) + [True]


def test_n_predict_past_the_context_stops_at_it(cluster: Cluster) -> None:
    """As llama.cpp does, where /v1/completions refuses such a max_tokens."""
    context = cluster.client.get("/props").json()["default_generation_settings"]["n_ctx"]
    prompt = [1] * (context - 3)
    whole = complete(cluster, prompt=prompt, n_predict=context, ignore_eos=True)
    assert (whole["stop_type"], whole["tokens_predicted"]) == ("limit", 3)
    refused = cluster.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": context})
    assert refused.status_code == 400
    assert complete(cluster, max_tokens=5, ignore_eos=True)["tokens_predicted"] == 5


def test_a_stopping_word_and_eos_say_what_ended_the_completion(cluster: Cluster) -> None:
    text = complete(cluster, n_predict=12)["content"]
    word = text.split()[1]
    stopped = complete(cluster, n_predict=12, stop=[word])
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert stopped["content"] == text[:text.index(word)]
    answered = complete(cluster, prompt="Is Paris in France? Answer:",
                        grammar='root ::= " yes" | " no"')
    assert answered["content"] in (" yes", " no") and answered["stop_type"] == "eos"


def test_probabilities_and_a_banned_token(cluster: Cluster) -> None:
    whole = complete(cluster, n_predict=3, n_probs=2, return_tokens=True)
    entries = whole["completion_probabilities"]
    assert len(entries) == 3
    first = entries[0]
    assert first["token"] == " Paris" and bytes(first["bytes"]) == b" Paris"
    [paris] = cluster.client.post("/tokenize", json={"content": " Paris"}).json()["tokens"]
    assert first["id"] == paris == whole["tokens"][0]
    assert first["top_logprobs"][0]["token"] == " Paris" and len(first["top_logprobs"]) == 2
    assert first["logprob"] == first["top_logprobs"][0]["logprob"] <= 0
    banned = complete(cluster, n_predict=3, logit_bias=[[" Paris", False]])
    assert not banned["content"].startswith(" Paris")


def test_props_tell_the_context_slots_and_template(cluster: Cluster) -> None:
    props = cluster.client.get("/props").json()
    card = cluster.client.get("/v1/models").json()["data"][0]
    assert props["default_generation_settings"]["n_ctx"] == card["max_model_len"]
    assert props["total_slots"] >= 1 and props["model_alias"] == cluster.model
    assert "<|im_start|>" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}


def test_n_predict_0_evaluates_the_prompt_alone(cluster: Cluster) -> None:
    """As llama.vim and llama.vscode warm llama.cpp's cache: nothing made, nothing shown."""
    for stream in (False, True):
        pieces = streamed(cluster, n_predict=0) if stream else [complete(cluster, n_predict=0,
                                                                           n_probs=2)]
        assert "".join(piece["content"] for piece in pieces) == ""
        last = pieces[-1]
        assert (last["stop"], last["stop_type"], last["tokens_predicted"]) == (True, "limit", 0)
        assert last["tokens_evaluated"] == len(cluster.client.post(
            "/tokenize", json={"content": PROMPT}).json()["tokens"])
        assert last.get("completion_probabilities", []) == []


def test_a_bad_body_is_a_400_and_an_unknown_model_a_404(cluster: Cluster) -> None:
    reply = cluster.client.post("/completion", json={"prompt": PROMPT, "n_predict": -2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n_predict"
    missing = cluster.client.post("/completion", json={"prompt": PROMPT, "model": "gpt-4o"})
    assert missing.status_code == 404


def test_a_stream_left_early_frees_its_blocks(cluster: Cluster) -> None:
    body = {"prompt": "Tell me a long story.", "n_predict": 4000, "ignore_eos": True,
            "stream": True}
    made_before = cluster.metric("raging_generation_tokens_total")
    with httpx.stream("POST", f"{cluster.url}/completion", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                wait_for(cluster.decoding, 30, "the completion to decode")
                break
    wait_for(cluster.idle, 5, "the decode worker to free the completion's blocks")
    # cut short, not run to the end of the context
    assert cluster.metric("raging_generation_tokens_total") - made_before < CLUSTER_CONTEXT / 2


def test_an_editor_s_line_limits_end_the_completion(cluster: Cluster) -> None:
    """llama.vim's and llama.vscode's `n_indent` (a line less indented than the cursor ends
    it) and `t_max_predict_ms` (past it, the line under way is the last)."""
    code = "def fibonacci(n):\n    if n < 2:\n"
    full = complete(cluster, prompt=code, n_predict=48)["content"]
    first, second = full.split("\n")[:2]
    indent = len(second) - len(second.lstrip(" "))
    assert 0 < indent < len(second), full  # the model's second line, indented
    cut = complete(cluster, prompt=code, n_predict=48, n_indent=indent + 1)
    assert cut["content"] == f"{first}\n{' ' * indent}" and cut["stop_type"] == "limit"
    kept = complete(cluster, prompt=code, n_predict=48, n_indent=indent)["content"]
    assert kept.startswith(f"{first}\n{second}\n") and full.startswith(kept)
    timed = complete(cluster, prompt=code, n_predict=48, t_max_predict_ms=1)
    content = timed["content"]
    assert full.startswith(content) and content.index("\n") == len(first)
    assert content[len(first):].strip(" \t\n") == "" and timed["stop_type"] == "limit"
