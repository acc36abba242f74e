"""Embeddings end to end on the real SmolLM2-135M-Instruct (fp32): the official `openai` and
`ollama` clients and llama.cpp's route get transformers' own last hidden state, normalized
(or not) as each API does; cut to `dimensions`; a cached prefix and a list longer than a window
change no vector; too long an input is refused or cut as asked; a client gone mid-list frees
every block. 1 gateway + 1 prefill + 1 decode (the decode worker's own prefill:
test_conditional.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import torch
from transformers import AutoTokenizer

from gateway.embeddings import WINDOW
from tests.e2e.cluster import Cluster, wait_for
from tests.reference import last_hidden_state

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

TEXTS = ["The capital of France is Paris.", "Bonjour", "Cats and dogs, living together."]
CLOSE = 1e-4  # fp32 on both sides: the same sums, in another order


@pytest.fixture(scope="module")
def ids(real_model_dir: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    return {text: tokenizer.encode(text) for text in TEXTS}


@pytest.fixture(scope="module")
def expected(real_model_dir: Path, ids: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """transformers' last hidden state of each text, not normalized."""
    return {text: last_hidden_state(real_model_dir, ids[text]) for text in TEXTS}


@pytest.fixture(scope="module")
def ollama_client(cluster: Cluster) -> Iterator[ollama.Client]:
    made = ollama.Client(host=cluster.url, timeout=120)
    yield made
    made._client.close()


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def close(got: list[float], expected: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), expected, atol=CLOSE, rtol=CLOSE)


def test_the_openai_client_gets_the_normalized_last_hidden_state(
        client: openai.OpenAI, expected: dict[str, torch.Tensor],
        ids: dict[str, list[int]]) -> None:
    reply = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)  # base64
    assert [e.index for e in reply.data] == [0, 1, 2] and reply.object == "list"
    for text, embedding in zip(TEXTS, reply.data, strict=True):
        assert close(embedding.embedding, unit(expected[text]))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids.values()))
    floats = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS[0],
                                      encoding_format="float")
    assert close(floats.data[0].embedding, torch.tensor(reply.data[0].embedding))


def test_token_ids_dimensions_and_a_cached_prefix(cluster: Cluster, real_model_dir: Path,
                                                  expected: dict[str, torch.Tensor]) -> None:
    long = [1000 + 37 * i % 4000 for i in range(40)]  # 2 full blocks of 16 before its last token
    reference = unit(last_hidden_state(real_model_dir, long)[:64])
    hits = prefix_cache_hits(cluster)
    for _ in range(2):  # the second time, its first 32 tokens' KV is cached
        reply = cluster.client.post("/v1/embeddings", json={"input": long, "dimensions": 64})
        assert reply.status_code == 200, reply.text
        assert close(reply.json()["data"][0]["embedding"], reference)
    assert prefix_cache_hits(cluster) - hits == 32
    raw = cluster.client.post("/v1/embeddings", json={"input": TEXTS[0], "normalize": False})
    assert close(raw.json()["data"][0]["embedding"], expected[TEXTS[0]])


def test_messages_are_embedded_as_the_chat_template_writes_them(cluster: Cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    tokens = cluster.client.post("/tokenize", json={"messages": messages,
                                                    "add_generation_prompt": False})
    as_ids = cluster.client.post("/v1/embeddings", json={"input": tokens.json()["tokens"]})
    chat = cluster.client.post("/v1/embeddings", json={"messages": messages})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    # the same tokens; the second may reuse the first's cached blocks, summed in another order
    assert close(chat.json()["data"][0]["embedding"],
                 torch.tensor(as_ids.json()["data"][0]["embedding"]))


def test_ollama_s_routes_and_llama_cpp_s(cluster: Cluster, ollama_client: ollama.Client,
                                        expected: dict[str, torch.Tensor]) -> None:
    embedded = ollama_client.embed(model="SmolLM2-135M-Instruct:latest", input=TEXTS[:2])
    assert embedded.prompt_eval_count and (embedded.total_duration or 0) > 0
    for text, vector in zip(TEXTS[:2], embedded.embeddings, strict=True):
        assert close(list(vector), unit(expected[text]))
    older = ollama_client.embeddings(model="SmolLM2-135M-Instruct", prompt=TEXTS[1])
    assert close(list(older.embedding), expected[TEXTS[1]])  # not normalized
    llama = cluster.client.post("/embedding", json={"content": TEXTS[2], "embd_normalize": 1})
    ((vector,),) = [item["embedding"] for item in llama.json()]
    taxicab = expected[TEXTS[2]].abs().sum()
    assert close(vector, expected[TEXTS[2]] / taxicab)


def test_more_inputs_than_a_window_come_back_in_order(cluster: Cluster,
                                                      client: openai.OpenAI) -> None:
    """Each input is an engine request as vLLM counts them: each ends "stop"."""
    before = finished(cluster)
    inputs = [[100 + i, 200 + 2 * i, 300 + 3 * i] for i in range(WINDOW + 8)]
    together = client.embeddings.create(model="SmolLM2-135M-Instruct", input=inputs)
    for index in (0, WINDOW - 1, WINDOW + 7):
        alone = client.embeddings.create(model="SmolLM2-135M-Instruct", input=[inputs[index]])
        assert close(together.data[index].embedding, torch.tensor(alone.data[0].embedding))
    grown = {reason: count - before[reason] for reason, count in finished(cluster).items()}
    assert grown == {"stop": WINDOW + 8 + 3, "abort": 0, "error": 0}


def test_too_long_an_input_is_refused_or_cut_as_asked(cluster: Cluster) -> None:
    context = int(cluster.client.get("/v1/models").json()["data"][0]["max_model_len"])
    long = [1000 + i % 500 for i in range(context + 10)]
    refused = cluster.client.post("/v1/embeddings", json={"input": [long]})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    cut = cluster.client.post("/v1/embeddings", json={"input": [long],
                                                      "truncate_prompt_tokens": 16})
    last = cluster.client.post("/v1/embeddings", json={"input": [long[-16:]]})
    assert cut.json()["usage"]["prompt_tokens"] == 16
    assert cut.json()["data"][0]["embedding"] == last.json()["data"][0]["embedding"]
    ollama_refused = cluster.client.post("/api/embed", json={"input": "x " * context,
                                                             "truncate": False})
    assert ollama_refused.status_code == 400 and "context" in ollama_refused.json()["error"]


def test_a_client_gone_mid_list_frees_every_block(cluster: Cluster) -> None:
    inputs = [[1000 + (i * 7 + j) % 3000 for j in range(400)] for i in range(200)]
    aborted, before = ended(cluster, "aborted"), finished(cluster)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.url}/v1/embeddings", json={"input": inputs}, timeout=1.0)
    wait_for(lambda: cluster.idle("prefill-0") and cluster.idle("decode-0"), 30,
             "both workers to hold nothing")
    assert ended(cluster, "aborted") == aborted + 1
    grown = {reason: count - before[reason] for reason, count in finished(cluster).items()}
    # the inputs sent (whole windows) each ended, the unfinished ones aborted
    assert grown["abort"] > 0 and grown["error"] == 0, grown
    sent = grown["stop"] + grown["abort"]
    assert sent % WINDOW == 0 or sent == len(inputs), grown


def prefix_cache_hits(cluster: Cluster) -> float:
    """vLLM's count of prompt tokens found cached, over every request so far."""
    model = cluster.client.get("/v1/models").json()["data"][0]["id"]
    return cluster.metric("vllm:prefix_cache_hits_total", f'model_name="{model}"')


def finished(cluster: Cluster) -> dict[str, float]:
    """vLLM's count of engine requests ended, by how, over every request so far."""
    model = cluster.client.get("/v1/models").json()["data"][0]["id"]
    return {reason: cluster.metric("vllm:request_success_total",
                                   f'finished_reason="{reason}",model_name="{model}"')
            for reason in ("stop", "abort", "error")}


def ended(cluster: Cluster, outcome: str) -> float:
    """Embedding requests ended so far with `outcome`."""
    try:
        return cluster.metric("raging_requests_total", f'outcome="{outcome}",route="embeddings"')
    except KeyError:  # none yet
        return 0.0
