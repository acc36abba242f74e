"""Prompts as token ids, and context checks, of gateway.prompts."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.weights.tokenizer import decode_text
from gateway.chat_request import parse_chat_request
from gateway.errors import APIError
from gateway.prompts import (
    bad_words_token_ids,
    check_context,
    render_chat_prompt,
    tokenize_prompt,
)
from gateway.protocol import TemplateOptions

MESSAGES = [{"role": "user", "content": "Hello!"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def test_render_chat_prompt_uses_template(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = parse_chat_request(chat()).messages
    ids = render_chat_prompt(tokenizer, messages)
    assert all(isinstance(token, int) for token in ids)
    text = decode_text(tokenizer, ids)
    assert text.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_render_chat_prompt_maps_developer_and_joins_parts(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    parts = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    body = chat(
        messages=[
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": parts},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "日本語 😀"},
        ]
    )
    text = decode_text(tokenizer, render_chat_prompt(tokenizer, parse_chat_request(body).messages))
    assert text == (
        "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nA\nB<|im_end|>\n"
        "<|im_start|>assistant\nSure.<|im_end|>\n<|im_start|>user\n日本語 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


class _RejectingTemplate:
    def apply_chat_template(self, *args: object, **kwargs: object) -> list[int]:
        raise TemplateError("Conversation roles must alternate user/assistant")


class _ListTemplate:
    def apply_chat_template(self, *args: object, **kwargs: object) -> list[int]:
        return [5, 6, 7]


def test_render_chat_prompt_template_errors_are_400() -> None:
    messages = parse_chat_request(chat()).messages
    with pytest.raises(APIError) as info:
        render_chat_prompt(_RejectingTemplate(), messages)  # type: ignore[arg-type]
    assert info.value.status == 400
    assert info.value.param == "messages"
    assert "alternate" in info.value.message


def test_render_chat_prompt_accepts_plain_list_output() -> None:
    messages = parse_chat_request(chat()).messages
    assert render_chat_prompt(_ListTemplate(), messages) == [5, 6, 7]  # type: ignore[arg-type]


def test_render_chat_prompt_continues_the_final_message(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    body = chat(messages=[{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "The moon is"}],
                add_generation_prompt=False, continue_final_message=True)
    request = parse_chat_request(body)
    options = TemplateOptions.of(request)
    text = decode_text(tokenizer, render_chat_prompt(tokenizer, request.messages,
                                                     options=options))
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe moon is")
    closed = TemplateOptions(add_generation_prompt=False)
    text = decode_text(tokenizer, render_chat_prompt(tokenizer, request.messages, options=closed))
    assert text.endswith("The moon is<|im_end|>\n")


def test_render_chat_prompt_passes_template_kwargs(real_model_dir: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    tokenizer.chat_template = ("{% if persona %}[{{ persona }}]{% endif %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    request = parse_chat_request(chat(chat_template_kwargs={"persona": "pirate"}))
    ids = render_chat_prompt(tokenizer, request.messages,
                             options=TemplateOptions.of(request))
    assert decode_text(tokenizer, ids) == "[pirate]Hello!"
    assert decode_text(tokenizer, render_chat_prompt(tokenizer, request.messages)) == "Hello!"


def test_bad_words_are_tokenized_as_vllm_does(tokenizer: PreTrainedTokenizerBase) -> None:
    words = bad_words_token_ids(tokenizer, ["Paris", " hello world"])
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    assert words == [encode("Paris"), encode(" Paris"), encode("hello world"),
                     encode(" hello world")]
    assert bad_words_token_ids(tokenizer, []) == []


def test_check_context_caps_a_request_without_max_tokens() -> None:
    assert check_context(100, None, 8192, 2048) == 2048
    assert check_context(7000, None, 8192, 2048) == 1192  # what the context leaves
    assert check_context(100, 4000, 8192, 2048) == 4000  # the request's own value wins
    assert check_context(100, None, 8192) == 8092


def test_tokenize_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenize_prompt(tokenizer, "hello world") == tokenizer.encode("hello world")
    assert tokenize_prompt(tokenizer, "hello world") == [28120, 905]
    assert tokenize_prompt(tokenizer, "") == []
    assert tokenize_prompt(tokenizer, [1, 2, 49151]) == [1, 2, 49151]


@pytest.mark.parametrize("ids", [[49152], [0, -1], [10**9]])
def test_tokenize_prompt_rejects_out_of_vocab(
    tokenizer: PreTrainedTokenizerBase, ids: list[int]
) -> None:
    with pytest.raises(APIError) as info:
        tokenize_prompt(tokenizer, ids)
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert "49152" in info.value.message


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "max_model_len", "expected"),
    [
        (10, None, 100, 90),
        (10, 5, 100, 5),
        (10, 90, 100, 90),
        (99, None, 100, 1),
        (1, 1, 2, 1),
    ],
)
def test_check_context_fits(
    prompt_len: int, max_tokens: int | None, max_model_len: int, expected: int
) -> None:
    assert check_context(prompt_len, max_tokens, max_model_len) == expected


def test_check_context_too_long_names_the_limits() -> None:
    with pytest.raises(APIError) as info:
        check_context(8000, 1000, 8192)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    for number in ("8192", "9000", "8000", "1000"):
        assert number in err.message


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(100, None), (150, None), (91, 10)])
def test_check_context_rejects_overflow(prompt_len: int, max_tokens: int | None) -> None:
    with pytest.raises(APIError) as info:
        check_context(prompt_len, max_tokens, 100)
    assert info.value.status == 400
    assert "100" in info.value.message and str(prompt_len) in info.value.message


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_a_prompt_over_the_context_is_blamed_whatever_max_tokens_says(
        max_tokens: int | None) -> None:
    with pytest.raises(APIError) as info:
        check_context(18031, max_tokens, 8192)
    err = info.value
    assert (err.status, err.param, err.code) == (400, None, "context_length_exceeded")
    assert "your prompt is 18031 tokens" in err.message


def test_check_context_rejects_empty_prompt() -> None:
    with pytest.raises(APIError) as info:
        check_context(0, 10, 100)
    assert info.value.status == 400
    assert "empty" in info.value.message
