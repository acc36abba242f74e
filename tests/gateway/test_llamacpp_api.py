"""llama.cpp's routes on the in-process gateway (real tokenizer, no workers): /apply-template,
/props, and a /completion that passes every check reaching dispatch."""

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
