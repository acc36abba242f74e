"""The embeddings benchmark's parts that start no server: its flags, the peers' commands for
embeddings, the texts, transformers' vectors of them, and the closed loop and the check against
a fake /v1/embeddings."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.embedding_results import EmbeddingPlan, summarize_run
from bench.embeddings import (
    LLAMA_CPP_POOLING,
    VLLM_POOLING,
    Batch,
    Corpus,
    Work,
    add_parser,
    batches,
    build_work,
    check_agreement,
    closed_loop,
    for_embeddings,
    output_path,
    plan_of,
    prepare,
    reference_vectors,
    set_flag,
)
from bench.peers import llamacpp_server, vllm_server


def _parse(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["embeddings", *words])


def test_flags() -> None:
    args = _parse("--peer", "vllm", "--launch", "p1d1=--prefill 1 --decode 1")
    assert plan_of(args) == EmbeddingPlan()
    args = _parse("--num-inputs", "16", "--input-tokens", "50", "--batch", "4",
                  "--concurrency", "1,2,8", "--warmup", "0", "--check", "3", "--cpus", "0-1")
    assert plan_of(args) == EmbeddingPlan(16, 50, 4, (1, 2, 8), 0, 3)
    assert args.cpus == (0, 1)
    with pytest.raises(ValueError, match="--batch"):
        plan_of(_parse("--batch", "0"))
    for bad in (("--concurrency", "0"), ("--concurrency", "a"), ("--peer", "sglang")):
        with pytest.raises(SystemExit):
            _parse(*bad)


def test_some_target_is_needed() -> None:
    with pytest.raises(ValueError, match="at least one"):
        prepare(_parse(), ["embeddings"])


def test_output_path(tmp_path: Path) -> None:
    assert output_path(tmp_path) == tmp_path / "embeddings.json"
    assert output_path(tmp_path / "e.json") == tmp_path / "e.json"
    assert output_path(None).name == "embeddings.json"


def test_set_flag_replaces_or_appends() -> None:
    assert set_flag(("a", "-c", "512", "b"), "-c", "9") == ("a", "-c", "9", "b")
    assert set_flag(("a",), "-ub", "9") == ("a", "-ub", "9")
    assert set_flag(("taskset", "-c", "0-1", "s", "-c", "512"), "-c", "9") == (
        "taskset", "-c", "0-1", "s", "-c", "9")


def test_vllm_serves_last_pooling_normalized() -> None:
    server = for_embeddings(vllm_server(Path("/v"), Path("/m"), "M", 8123, (0, 1)),
                            EmbeddingPlan())
    words = server.command
    assert words[-len(VLLM_POOLING):] == VLLM_POOLING
    assert words[words.index("--runner") + 1] == "pooling"
    assert words[words.index("--convert") + 1] == "embed"
    assert json.loads(words[words.index("--pooler-config") + 1]) == {
        "pooling_type": "LAST", "use_activation": True}
    assert words[words.index("--dtype") + 1] == "float32"


def _llama(plan: EmbeddingPlan) -> tuple[str, ...]:
    server = llamacpp_server(Path("/b/llama-server"), Path("/g.gguf"), "M", 8124, (0, 1), 4)
    return for_embeddings(server, plan).command


def _value(words: tuple[str, ...], flag: str) -> int:
    server = words[3:]  # after `taskset -c CPUS`
    assert server.count(flag) == 1
    return int(server[server.index(flag) + 1])


def test_llamacpp_embeds_with_last_pooling_a_slot_per_input_in_flight() -> None:
    words = _llama(EmbeddingPlan(batch=8, concurrencies=(1, 4)))
    assert words[-len(LLAMA_CPP_POOLING):] == ("--embeddings", "--pooling", "last")
    assert _value(words, "-np") == 32
    assert _value(words, "-c") == 32 * 512
    assert words[:3] == ("taskset", "-c", "0-1")
    assert (_value(words, "-ub"), _value(words, "-b")) == (2048, 2048)


def test_llamacpp_holds_a_long_input_in_one_physical_batch() -> None:
    words = _llama(EmbeddingPlan(input_tokens=3000, batch=2, concurrencies=(1,)))
    assert (_value(words, "-np"), _value(words, "-c")) == (2, 2 * 3064)
    assert (_value(words, "-ub"), _value(words, "-b")) == (3064, 3064)


def test_texts_are_as_long_as_asked_and_never_share_a_prefix(tiny_model_dir: Path) -> None:
    corpus = Corpus.of(tiny_model_dir, 60)
    texts = corpus.texts("Run 0", 3)
    assert len(set(texts)) == 3 and texts[1].startswith("Run 0, text 1. ")
    assert corpus.texts("Run 0", 3) == texts  # the same for every target
    assert not set(corpus.texts("Run 1", 3)) & set(texts)
    assert all(abs(corpus.count(text) - 60) <= 2 for text in texts)
    requests = batches(corpus, corpus.texts("Run 0", 5), 2)
    assert [(b.index, len(b.texts)) for b in requests] == [(0, 2), (1, 2), (2, 1)]
    assert requests[2].tokens == corpus.count(corpus.texts("Run 0", 5)[4])


def test_work_gives_each_run_its_own_texts(tiny_model_dir: Path) -> None:
    corpus = Corpus.of(tiny_model_dir, 20)
    plan = EmbeddingPlan(num_inputs=5, input_tokens=20, batch=2, concurrencies=(1, 4),
                         warmup=1, check=3)
    seen: list[tuple[str, ...]] = []

    def references(texts: Any) -> tuple[tuple[float, ...], ...]:
        seen.append(tuple(texts))
        return tuple((1.0,) for _ in texts)

    work = build_work(plan, corpus, references)
    assert seen == [work.check] and len(work.check) == 3 and len(work.references) == 3
    assert [len(b.texts) for b in work.warmup] == [2]
    assert [[len(b.texts) for b in run] for run in work.runs] == [[2, 2, 1], [2, 2, 1]]
    first, second = ({t for b in run for t in b.texts} for run in work.runs)
    assert not first & second and not first & set(work.check)


def test_reference_vectors_are_transformers_last_states_normalized(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["The river ran to the sea.", "A recipe lists what to buy"]
    vectors = reference_vectors(tiny_model_dir, tokenizer, texts)
    assert reference_vectors(tiny_model_dir, tokenizer, []) == ()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        state = model.model(torch.tensor([tokenizer.encode(texts[1])])).last_hidden_state[0, -1]
    assert len(vectors) == 2 and len(vectors[0]) == 64
    assert math.fsum(x * x for x in vectors[0]) == pytest.approx(1.0)
    assert torch.allclose(torch.tensor(vectors[1]), state / state.norm(), atol=1e-6)


def _fake_server(fail: set[str]) -> httpx.AsyncClient:
    """A /v1/embeddings that answers each text with (len(text), 1) and fails texts in `fail`."""
    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["encoding_format"] == "float" and body["model"] == "M"
        if fail & set(body["input"]):
            return httpx.Response(503, json={"error": "busy"})
        data = [{"index": i, "embedding": [float(len(text)), 1.0]}
                for i, text in reversed(list(enumerate(body["input"])))]
        return httpx.Response(200, json={"data": data,
                                         "usage": {"prompt_tokens": 3 * len(body["input"])}})
    return httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://fake")


def test_closed_loop_times_each_request_and_records_failures() -> None:
    requests = [Batch(i, (f"t{i}a", f"t{i}b"), 10) for i in range(5)]

    async def run() -> Any:
        async with _fake_server({"t3a"}) as client:
            return await closed_loop(client, "M", requests, 2, 10.0, "test")

    result = asyncio.run(run())
    assert result.concurrency == 2 and [r.index for r in result.requests] == [0, 1, 2, 3, 4]
    assert result.requests[3].error.startswith("HTTP 503")
    assert result.requests[0].ok and result.requests[0].usage_tokens == 6
    summary = summarize_run(result)
    assert (summary.completed, summary.inputs, summary.errors) == (4, 8, {"HTTP 503": 1})
    assert summary.usage_tokens_per_input == pytest.approx(3)


def test_check_compares_the_servers_vectors_in_input_order() -> None:
    work = Work((), ("ab", "abcd"), ((2.0, 1.0), (1.0, 0.0)), ())

    async def check(fail: set[str]) -> Any:
        async with _fake_server(fail) as client:
            return await check_agreement(client, "M", work)

    found = asyncio.run(check(set()))
    assert found.inputs == 2 and found.mean_cosine == pytest.approx((1 + 4 / 17 ** 0.5) / 2)
    assert found.min_cosine == pytest.approx(4 / 17 ** 0.5)
    failed = asyncio.run(check({"ab"}))
    assert failed.error.startswith("HTTP 503") and math.isnan(failed.mean_cosine)
