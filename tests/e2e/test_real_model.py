"""End to end on the real SmolLM2-135M-Instruct, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

from engine.weights.tokenizer import decode_text
from tests.e2e.cluster import Cluster, launch, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def cluster(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), real_model_dir, prefill=1, decode=1) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def reference_answers(model_dir: Path, max_tokens: int,
                      questions: list[str] = QUESTIONS) -> list[str]:
    """What transformers' own greedy generate says to each question."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answers = []
    for question in questions:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
        assert isinstance(encoded, BatchEncoding)
        ids = encoded["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        answers.append(decode_text(tokenizer, out[0, ids.shape[1]:].tolist(),
                                   skip_special_tokens=True))
    return answers


def test_greedy_answers_equal_transformers(
    cluster: Cluster, client: openai.OpenAI, real_model_dir: Path
) -> None:
    expected = reference_answers(real_model_dir, 32)
    for question, answer in zip(QUESTIONS, expected, strict=True):
        reply = client.chat.completions.create(
            model=cluster.model, messages=[{"role": "user", "content": question}],
            max_tokens=32, temperature=0)
        assert reply.choices[0].message.content == answer
    assert "Paris" in expected[0]


def test_guessed_tokens_keep_the_greedy_answer(
    cluster: Cluster, client: openai.OpenAI, real_model_dir: Path
) -> None:
    """An answer that repeats its question: n-gram speculation (on by default) guesses much of
    it, and the answer is still transformers' own."""
    question = ("Repeat this sentence three times: the old lighthouse keeper climbed the "
                "stairs every night to light the lamp.")
    (expected,) = reference_answers(real_model_dir, 64, [question])
    guessed, kept = (cluster.metric(name, 'worker="decode-0"')
                     for name in ("raging_guessed_tokens_total", "raging_kept_guesses_total"))
    reply = client.chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": question}],
        max_tokens=64, temperature=0)
    assert reply.choices[0].message.content == expected
    assert "lighthouse keeper climbed the stairs" in expected  # copied from the question

    def counts() -> tuple[float, float]:
        return (cluster.metric("raging_guessed_tokens_total", 'worker="decode-0"') - guessed,
                cluster.metric("raging_kept_guesses_total", 'worker="decode-0"') - kept)
    wait_for(lambda: counts()[1] >= 5, 5, "the heartbeat with the guesses")
    print(f"guessed {counts()[0]:.0f} tokens, kept {counts()[1]:.0f}")


def test_streaming_with_the_openai_client(cluster: Cluster, client: openai.OpenAI) -> None:
    request = {"model": cluster.model, "max_tokens": 40, "temperature": 0,
               "messages": [{"role": "user", "content": QUESTIONS[1]}]}
    whole = client.chat.completions.create(**request)
    stream = client.chat.completions.create(**request, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and
               c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_and_errors_through_the_client(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    reply = client.completions.create(model=cluster.model, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert reply.choices[0].text and reply.usage is not None
    assert reply.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=cluster.model, prompt="x", max_tokens=100_000)
    assert "maximum context length" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
