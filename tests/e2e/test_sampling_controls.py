"""Sampling controls and logprobs end to end, on a tiny random Llama: 1 gateway + 1 prefill +
1 decode real processes, checked against transformers running the same model.

The model has a second EOS id: the token greedy decoding of PROMPT gives second, so that EOS
and min_tokens can be seen at work on a random model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerBase,
    RepetitionPenaltyLogitsProcessor,
)

from engine.weights.tokenizer import decode_text
from gateway.logprobs import TokenPieces
from gateway.prompts import render_chat_prompt
from gateway.protocol import ChatMessage
from tests.e2e.cluster import Cluster, greedy_reference, launch, sse_events

pytestmark = pytest.mark.e2e

PROMPT = "Once upon a time"
PROMPTS = [PROMPT, "The quick brown fox", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Say something"}]
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Controls:
    """The sampling controls the reference applies, as the server's request fields name them."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def fields(self) -> dict[str, Any]:
        """The request fields of the controls that are not neutral."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default}
        if self.logit_bias:
            fields["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        return fields


class Reference:
    """transformers' greedy continuation under the same controls, and each step's logprobs."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_tokens: int, controls: Controls | None = None,
            stops: frozenset[int] = frozenset()) -> tuple[list[int], list[torch.Tensor]]:
        """(token ids, the log-softmax each was drawn from); it stops after a stop token."""
        controls = controls or Controls()
        out = self.model(torch.tensor([prompt_ids]), use_cache=True)
        generated: list[int] = []
        logprobs: list[torch.Tensor] = []
        while len(generated) < max_tokens:
            logits = penalized(out.logits[0, -1].float(), prompt_ids, generated, controls)
            if len(generated) < controls.min_tokens and stops:
                logits[list(stops)] = -torch.inf
            logprobs.append(torch.log_softmax(logits, dim=-1))
            generated.append(int(logits.argmax()))
            if generated[-1] in stops:
                break
            out = self.model(torch.tensor([generated[-1:]]), past_key_values=out.past_key_values,
                             use_cache=True)
        return generated, logprobs


def penalized(logits: torch.Tensor, prompt_ids: list[int], generated: list[int],
              controls: Controls) -> torch.Tensor:
    """transformers' repetition penalty (prompt + output), then OpenAI's presence and
    frequency penalties (output only), then the logit bias."""
    if controls.repetition_penalty != 1:
        ids = torch.tensor([[*prompt_ids, *generated]])
        logits = RepetitionPenaltyLogitsProcessor(controls.repetition_penalty)(
            ids, logits[None].clone())[0]
    counts = torch.zeros_like(logits)
    for token in generated:
        counts[token] += 1
    penalized = (logits - controls.frequency_penalty * counts
                 - controls.presence_penalty * (counts > 0).float())
    for token, bias in controls.logit_bias:
        penalized[token] += bias
    return penalized


@pytest.fixture(scope="module")
def eos(tiny_model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> int:
    """The token greedy decoding of PROMPT gives second (and not first)."""
    first, second = greedy_reference(tiny_model_dir)(tokenizer.encode(PROMPT), 2)
    assert first != second
    return second


@pytest.fixture(scope="module")
def model_dir(make_tiny_model: Callable[..., Path], eos: int) -> Path:
    return make_tiny_model(eos_token_id=[2, eos])  # the same weights: seeded the same


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def pieces(tokenizer: PreTrainedTokenizerBase) -> TokenPieces:
    return TokenPieces(tokenizer)


def complete(cluster: Cluster, prompt: str, max_tokens: int, stream: bool = False,
             **fields: Any) -> dict[str, Any]:
    """A /v1/completions reply (greedy unless `fields` say otherwise), streamed or not, as
    {text, finish_reason, completion_tokens, logprobs (the streamed ones joined)}."""
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **fields}
    if not stream:
        reply = cluster.client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return {**choice, "completion_tokens": reply.json()["usage"]["completion_tokens"]}
    body["stream_options"] = {"include_usage": True}
    with cluster.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [e for e in sse_events(response) if isinstance(e, dict)]
    choices = [e["choices"][0] for e in events if e["choices"]]
    logprobs = None
    if choices[0]["logprobs"] is not None:
        logprobs = {key: [v for c in choices for v in c["logprobs"][key]]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return {"text": "".join(c["text"] for c in choices), "logprobs": logprobs,
            "finish_reason": next(c["finish_reason"] for c in choices if c["finish_reason"]),
            "completion_tokens": events[-1]["usage"]["completion_tokens"]}


def chat(cluster: Cluster, max_tokens: int, stream: bool, **fields: Any) -> dict[str, Any]:
    """A /v1/chat/completions reply as {content, logprobs content (streamed ones joined)}."""
    body = {"model": cluster.model, "messages": CHAT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **fields}
    if not stream:
        reply = cluster.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return {"content": choice["message"]["content"], "entries": choice["logprobs"]["content"]}
    with cluster.client.stream("POST", "/v1/chat/completions", json=body) as response:
        choices = [e["choices"][0] for e in sse_events(response) if isinstance(e, dict)]
    assert choices[0]["logprobs"] is None  # the role chunk carries no token
    entries = [entry for c in choices[1:] for entry in c["logprobs"]["content"]]
    assert all(c["logprobs"]["refusal"] is None for c in choices[1:])
    return {"content": "".join(c["delta"].get("content", "") for c in choices), "entries": entries}


def text_of(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    return decode_text(tokenizer, ids, skip_special_tokens=True)


# --- min_tokens, EOS and stop_token_ids ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_eos_ends_a_completion_unless_min_tokens_holds_it_back(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference, eos: int,
    stream: bool,
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    plain = complete(cluster, PROMPT, 20, stream)
    assert (plain["finish_reason"], plain["completion_tokens"]) == ("stop", 2)
    held = complete(cluster, PROMPT, 20, stream, min_tokens=6)
    expected, _ = reference.run(prompt_ids, 20, Controls(min_tokens=6), frozenset({2, eos}))
    stopped = expected[-1] in (2, eos)
    assert held["completion_tokens"] == len(expected) >= 6
    assert held["text"] == text_of(tokenizer, expected[:-1] if stopped else expected)
    assert held["finish_reason"] == ("stop" if stopped else "length")
    ignored = complete(cluster, PROMPT, 20, stream, ignore_eos=True)
    assert ignored["completion_tokens"] == 20


def test_min_tokens_holds_back_stop_token_ids_from_the_first_token_on(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
) -> None:
    """The first token is the prefill worker's: its draw obeys min_tokens too."""
    prompt_ids = tokenizer.encode(PROMPTS[1])
    plain, _ = reference.run(prompt_ids, 1)
    stops = frozenset(plain)
    cut = complete(cluster, PROMPTS[1], 10, ignore_eos=True, stop_token_ids=plain)
    assert (cut["text"], cut["finish_reason"], cut["completion_tokens"]) == ("", "stop", 1)
    for min_tokens in (1, 4):
        held = complete(cluster, PROMPTS[1], 10, ignore_eos=True, stop_token_ids=plain,
                        min_tokens=min_tokens)
        expected, _ = reference.run(prompt_ids, 10, Controls(min_tokens=min_tokens), stops)
        assert expected[0] != plain[0]
        assert held["completion_tokens"] == len(expected)
        assert held["text"] == text_of(tokenizer, [t for t in expected if t not in stops])


def test_min_tokens_above_max_tokens_is_refused(cluster: Cluster) -> None:
    body = {"model": cluster.model, "prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}
    reply = cluster.client.post("/v1/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "min_tokens"


# --- penalties --------------------------------------------------------------------------------


PENALTIES = [Controls(presence_penalty=1.5), Controls(frequency_penalty=0.8),
             Controls(repetition_penalty=1.4), Controls(repetition_penalty=0.7),
             Controls(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=1.2)]


@pytest.mark.parametrize("controls", PENALTIES, ids=lambda c: str(c.fields()))
def test_greedy_penalized_output_matches_transformers(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
    controls: Controls,
) -> None:
    changed = 0
    for index, prompt in enumerate(PROMPTS):
        prompt_ids = tokenizer.encode(prompt)
        expected, _ = reference.run(prompt_ids, 24, controls)
        got = complete(cluster, prompt, 24, index % 2 == 1, ignore_eos=True, **controls.fields())
        assert got["text"] == text_of(tokenizer, expected), prompt
        changed += expected != reference.run(prompt_ids, 24)[0]
    assert changed  # the penalty changed something


def test_logit_bias_steers_greedy_output_as_transformers_with_the_bias_added(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
) -> None:
    """+100 on a token makes every token it (the prefill worker's first one too); -100 on
    the greedy tokens moves output off them; logprobs show the biased numbers."""
    prompt_ids = tokenizer.encode(PROMPTS[2])
    plain, _ = reference.run(prompt_ids, 12)
    forced = complete(cluster, PROMPTS[2], 6, ignore_eos=True, logit_bias={"42": 100})
    assert forced["text"] == text_of(tokenizer, [42] * 6)
    for controls in (Controls(logit_bias=tuple((t, -100.0) for t in set(plain[:3]))),
                     Controls(logit_bias=((plain[1], -3.0), (7, 4.5)))):
        expected, logprobs = reference.run(prompt_ids, 12, controls)
        got = complete(cluster, PROMPTS[2], 12, True, ignore_eos=True, logprobs=1,
                       **controls.fields())
        assert got["text"] == text_of(tokenizer, expected) and expected != plain
        assert_close(got["logprobs"]["token_logprobs"],
                     [float(lp[t]) for lp, t in zip(logprobs, expected, strict=True)])


def test_seeded_sampling_with_penalties_repeats_and_stop_strings_cut(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
) -> None:
    fields: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "presence_penalty": 1.0,
                              "repetition_penalty": 1.2, "ignore_eos": True}
    first, again = (complete(cluster, PROMPT, 24, stream, seed=7, **fields)["text"]
                    for stream in (False, True))
    other = complete(cluster, PROMPT, 24, seed=8, **fields)["text"]
    assert first == again != other
    controls = Controls(presence_penalty=1.0, repetition_penalty=1.2)
    full = text_of(tokenizer, reference.run(tokenizer.encode(PROMPT), 32, controls)[0])
    stop = full[len(full) // 2: len(full) // 2 + 4]
    cut = complete(cluster, PROMPT, 32, True, stop=[stop], ignore_eos=True, **controls.fields())
    assert (cut["text"], cut["finish_reason"]) == (full[: full.index(stop)], "stop")


# --- logprobs ---------------------------------------------------------------------------------


def assert_close(got: list[float], expected: list[float]) -> None:
    assert got == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize("controls", [Controls(), Controls(presence_penalty=1.5,
                                                           repetition_penalty=1.3)],
                         ids=["raw", "penalized"])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_match_transformers(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
    pieces: TokenPieces, stream: bool, controls: Controls,
) -> None:
    prompt_ids = tokenizer.encode(PROMPTS[2])
    ids, steps = reference.run(prompt_ids, 12, controls)
    got = complete(cluster, PROMPTS[2], 12, stream, logprobs=5, ignore_eos=True,
                   **controls.fields())["logprobs"]
    assert got["tokens"] == [pieces(i).text for i in ids]
    assert_close(got["token_logprobs"], [float(lp[i]) for lp, i in zip(steps, ids, strict=True)])
    for top, token, step in zip(got["top_logprobs"], got["tokens"], steps, strict=True):
        values, best = step.topk(5)
        assert token in top and 5 <= len(top) <= 6
        assert {pieces(i).text for i in best.tolist()} <= set(top)
        assert_close(sorted(top.values(), reverse=True)[:5], values.tolist())
    offsets = got["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_transformers(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
    pieces: TokenPieces, stream: bool,
) -> None:
    prompt_ids = render_chat_prompt(tokenizer, [ChatMessage.model_validate(m) for m in CHAT])
    ids, steps = reference.run(prompt_ids, 10)
    got = chat(cluster, 10, stream, logprobs=True, top_logprobs=3)
    assert got["content"] == text_of(tokenizer, ids)
    assert [e["token"] for e in got["entries"]] == [pieces(i).text for i in ids]
    assert [bytes(e["bytes"]) for e in got["entries"]] == [pieces(i).data for i in ids]
    for entry, token, step in zip(got["entries"], ids, steps, strict=True):
        assert entry["logprob"] == pytest.approx(float(step[token]), abs=TOLERANCE)
        values, best = step.topk(3)
        assert {t["token"] for t in entry["top_logprobs"]} == {pieces(i).text for i in
                                                                best.tolist()}
        assert_close([t["logprob"] for t in entry["top_logprobs"]], values.tolist())
    no_top = chat(cluster, 4, stream, logprobs=True)
    assert [e["top_logprobs"] for e in no_top["entries"]] == [[]] * 4


# --- echo: the prompt's own logprobs --------------------------------------------------------

LONG_PROMPT = " ".join(f"item {i} of the list," for i in range(120))  # past one 512-token chunk
ONE_TOKEN_PROMPT = "Hello"
UNICODE_PROMPT = "héllo wörld 🎉 日本語 ok"  # tokens holding pieces of characters


def prompt_steps(reference: Reference, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position but the last."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 5])
def test_echo_scores_the_prompt_as_transformers(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase, reference: Reference,
    pieces: TokenPieces, stream: bool, max_tokens: int,
) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens 0 or more):
    each prompt token's logprob and top tokens, a long prompt's across prefill chunks, a
    one-token prompt's none but its null, then the completion's as ever."""
    assert len(tokenizer.encode(ONE_TOKEN_PROMPT)) == 1
    for prompt in (PROMPTS[2], LONG_PROMPT, ONE_TOKEN_PROMPT, UNICODE_PROMPT):
        ids = tokenizer.encode(prompt)
        steps = prompt_steps(reference, ids)
        got = complete(cluster, prompt, max_tokens, stream, echo=True, logprobs=3,
                       ignore_eos=True)
        output = reference.run(ids, max_tokens)[0] if max_tokens else []
        assert got["text"] == text_of(tokenizer, ids) + text_of(tokenizer, output)
        assert (got["completion_tokens"], got["finish_reason"]) == (max_tokens, "length")
        logprobs = got["logprobs"]
        assert logprobs["tokens"] == [pieces(i).text for i in [*ids, *output]]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert_close(logprobs["token_logprobs"][1:len(ids)],
                     steps[torch.arange(len(ids) - 1), ids[1:]].tolist())
        for top, step in zip(logprobs["top_logprobs"][1:len(ids)], steps, strict=True):
            assert {pieces(i).text for i in step.topk(3).indices.tolist()} <= set(top)
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert max(offsets[:len(ids)]) <= len(text_of(tokenizer, ids))
        assert len(ids) > 512 or prompt != LONG_PROMPT


def test_echo_without_logprobs_starts_every_choice_with_its_prompt(
    cluster: Cluster, tokenizer: PreTrainedTokenizerBase,
) -> None:
    body = {"model": cluster.model, "prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 3,
            "temperature": 0.8, "seed": 3, "n": 2, "echo": True}
    reply = cluster.client.post("/v1/completions", json=body).json()
    for choice in reply["choices"]:
        prompt = PROMPTS[choice["index"] // 2]
        assert choice["text"].startswith(text_of(tokenizer, tokenizer.encode(prompt)))
        assert choice["logprobs"] is None
    refused = cluster.client.post("/v1/completions", json={**body, "echo": False,
                                                          "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] is None


def test_no_logprobs_unless_asked(cluster: Cluster) -> None:
    assert complete(cluster, PROMPT, 3, ignore_eos=True)["logprobs"] is None
    assert complete(cluster, PROMPT, 3, True, ignore_eos=True)["logprobs"] is None


def test_the_openai_client_reads_logprobs_of_both_apis(cluster: Cluster) -> None:
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    whole = client.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=6,
                                      temperature=0, logprobs=2, extra_body=extra)
    streamed = client.completions.create(model=cluster.model, prompt=PROMPT, max_tokens=6,
                                         temperature=0, logprobs=2, stream=True, extra_body=extra)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices]
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 6
    assert [lp for c in chunks if c for lp in c.token_logprobs or []] == logprobs.token_logprobs
    assert all(isinstance(top, dict) and len(top) >= 2 for top in logprobs.top_logprobs or [])
    assert logprobs.text_offset is not None and len(logprobs.text_offset) == 6
    messages: Any = CHAT
    reply = client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body=extra)
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    assert all(len(c.top_logprobs) == 2 and isinstance(c.bytes, list) for c in content)
    chat_stream = client.chat.completions.create(
        model=cluster.model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body=extra)
    streamed_content = [entry for c in chat_stream if c.choices and c.choices[0].logprobs
                        for entry in c.choices[0].logprobs.content or []]
    assert [(c.token, c.logprob) for c in streamed_content] == [(c.token, c.logprob)
                                                                for c in content]
