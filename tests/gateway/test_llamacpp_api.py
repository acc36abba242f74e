"""llama.cpp's routes on the in-process gateway (real tokenizer, no workers): /apply-template,
/props, and a /completion (or an /infill, for a model that can fill) that passes every check
reaching dispatch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.gateway.served_app import (
    MAX_MODEL_LEN,
    MODEL,
    error_of,
    is_no_worker,
    serve_without_workers,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(real_model_dir: Path) -> Iterator[TestClient]:
    with serve_without_workers(real_model_dir) as client:
        yield client


def test_apply_template_gives_the_prompt_chat_would_compute(client: TestClient) -> None:
    prompt = client.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert client.post("/tokenize", json={"content": prompt}).json()["tokens"] == tokens
    continued = client.post("/apply-template", json={
        "messages": [*MESSAGES, {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True, "add_generation_prompt": False}).json()["prompt"]
    assert continued.endswith("<|im_start|>assistant\nHel")
    reply = client.post("/apply-template", json={"prompt": "x"})
    assert reply.status_code == 400 and error_of(reply)["param"] == "messages"


def test_props_without_workers(client: TestClient) -> None:
    props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN
    assert props["default_generation_settings"]["params"]["temperature"] == 0.2
    assert (props["total_slots"], props["model_alias"]) == (0, MODEL)
    assert props["eos_token"] == "<|im_end|>"


def test_a_valid_completion_reaches_dispatch(client: TestClient) -> None:
    for route in ("/completion", "/completions"):
        assert is_no_worker(client.post(route, json={"prompt": "Hi", "n_predict": 4}))


def test_an_infill_needs_a_model_that_can_fill_in_the_middle(
        client: TestClient, tiny_coder_dir: Path) -> None:
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4}
    refused = client.post("/infill", json=body)
    assert refused.status_code == 400 and "fill-in-the-middle" in error_of(refused)["message"]
    with serve_without_workers(tiny_coder_dir) as coder:
        assert is_no_worker(coder.post("/infill", json=body))
        extra = [{"filename": "a.py", "text": "A = 1"}, {"text": "B = 2"}]
        assert is_no_worker(coder.post("/infill", json={**body, "input_extra": extra,
                                                        "prompt": "return"}))
        for bad, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
                           ({"input_extra": [{"text": 5}]}, "input_extra[0].text"),
                           ({"input_extra": "a.py"}, "input_extra")):
            reply = coder.post("/infill", json={**body, **bad})
            assert reply.status_code == 400 and error_of(reply)["param"] == param, reply.text
