"""Prompts as token ids: chat messages under the model's chat template (`render_chat_prompt`,
with tools, earlier calls and their results as gateway/tools.py shows them), completion prompts
(`tokenize_prompt`), vLLM's `bad_words`; and `check_context`, which fits prompt and completion
into the model's context."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from gateway.errors import bad_request
from gateway.protocol import ChatMessage, TemplateOptions
from gateway.tools import ToolPlan, template_uses_tools, with_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PLAIN = TemplateOptions()  # the messages as they are, then the assistant's cue


def render_chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage],
    *, tools: ToolPlan | None = None, options: TemplateOptions = PLAIN,
) -> list[int]:
    """Token ids of `messages` under the model's chat template, by default ending in the
    assistant cue; offered `tools`, earlier calls and tool results as gateway/tools.py renders
    them."""
    return _token_ids(_applied(tokenizer, messages, tools, options, tokenize=True))


def render_chat_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage],
                     options: TemplateOptions = PLAIN) -> str:
    """The text the chat template makes of `messages`, as `render_chat_prompt` tokenizes it."""
    text = _applied(tokenizer, messages, None, options, tokenize=False)
    assert isinstance(text, str), "an untokenized template is text"
    return text


def _applied(tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage],
             tools: ToolPlan | None, options: TemplateOptions, tokenize: bool) -> object:
    conversation, shown = with_tools([_template_message(message) for message in messages],
                                     messages, tools, _uses_tools(tokenizer))
    template_tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
        None if shown is None else list(shown))
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=template_tools, add_generation_prompt=options.add_generation_prompt,
            tokenize=tokenize, continue_final_message=options.continue_final_message,
            **(options.kwargs or {}),
        )
    except (TemplateError, ValueError) as exc:  # ValueError: a final message to continue
        raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from None


def _uses_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and template_uses_tools(template)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    # Chat templates predate OpenAI's "developer" role; it means "system" to them.
    role = "system" if message.role == "developer" else message.role
    entry: dict[str, Any] = {"role": role, "content": message.text}
    if message.name is not None:
        entry["name"] = message.name
    thought = message.reasoning_content or message.reasoning
    if thought:  # as Qwen3's template reads it (others ignore it)
        entry["reasoning_content"] = thought
    return entry


def _token_ids(encoded: object) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if not isinstance(ids, list):
        raise TypeError(f"unexpected chat template output {type(ids).__name__}")
    return [int(token) for token in ids]


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> list[int]:
    """Token ids of a completion prompt; given ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    vocab_size = len(tokenizer)
    if any(not 0 <= token < vocab_size for token in prompt):
        raise bad_request(
            f"prompt token ids must be in the range [0, {vocab_size})", param="prompt"
        )
    return list(prompt)


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase,
                        words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word as it is, and with a leading space (how
    it reads mid-text) where that makes other tokens of the same count."""
    banned: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        banned.append(plain)
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            banned.append(spaced)
    return [ids for ids in banned if ids]


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  default_max_tokens: int | None = None) -> int:
    """The effective max_tokens for a prompt, or a 400 when it cannot fit the context; a
    request with no max_tokens gets `default_max_tokens` or what the context leaves, the less."""
    if prompt_len <= 0:
        raise bad_request("The prompt is empty: it must contain at least one token.")
    if prompt_len >= max_model_len:  # the prompt is at fault, whatever max_tokens says
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt is {prompt_len} tokens, which leaves no room for the completion. "
            "Please reduce the length of the prompt.",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return min(max_model_len - prompt_len, default_max_tokens or max_model_len)
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt "
            "or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
