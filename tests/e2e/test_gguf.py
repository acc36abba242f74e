"""A GGUF file served directly (`--model FILE.gguf`) by a real 1P+1D cluster, each worker
multiplying the file's quant blocks alone: greedy streams equal to transformers' from the same
file, a chat answer through the chat template the file carries."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gguf import SHAPES, write_random_gguf
from tests.e2e.cluster import TEST_CONFIG, greedy_reference, launch
from tests.engine.weights.test_gguf import SMALL_VOCAB

pytestmark = pytest.mark.e2e


def test_a_gguf_file_is_served_from_its_quant_blocks(tmp_path: Path) -> None:
    gguf = tmp_path / "random-tiny.gguf"
    write_random_gguf(gguf, SHAPES["tiny"], seed=5, scale=0.2, vocab=SMALL_VOCAB)
    reference = greedy_reference(gguf)
    config = {**TEST_CONFIG, "model": {**TEST_CONFIG["model"], "weights": "quant",
                                       "cache_dir": str(tmp_path / "models")}}
    prompts = [[5 + 7 * i + j for j in range(n)] for i, n in enumerate((9, 40))]
    with launch(tmp_path / "run", gguf, prefill=1, decode=1, config=config) as cluster:
        for prompt in prompts:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
            answer = cluster.client.post("/v1/completions", json=body).json()
            text = cluster.client.post("/detokenize", json={
                "model": cluster.model, "tokens": reference(prompt, 12)}).json()
            assert answer["choices"][0]["text"] == text["prompt"]
        chat = {"model": cluster.model, "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello"}]}
        reply = cluster.client.post("/v1/chat/completions", json=chat).json()
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] == 5
    assert cluster.model == "random-tiny"
    assert [path.name for path in (tmp_path / "models" / "gguf").glob("*/*")] == ["random-tiny"]
    for worker in ("prefill-0", "decode-0"):  # the head and 2 layers' 4 products each
        log = (tmp_path / "run" / f"{worker}.log").read_text()
        assert "9 of 9 matrices are read from them only" in log
