"""Fill-in-the-middle prompts: each code family's markers found in a vocabulary (the real
tokenizer with them added, as a code model's ships them), and the layouts built of them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerBase

from engine.weights.tokenizer import load_tokenizer
from gateway.infill import FillTokens, Gap, fill_prompt, fill_tokens

QWEN_CODER = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>")
FAMILIES = {
    "qwen2.5-coder": QWEN_CODER,
    "codegemma": ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|file_separator|>"),
    "starcoder": ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"),
    "deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # noqa: RUF001
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"),
}
MARKERS = {  # (prefix, suffix, middle) of each
    "qwen2.5-coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "codegemma": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # noqa: RUF001
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>"),
}


@pytest.fixture(scope="module")
def plain(real_model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(real_model_dir)


def with_tokens(tokenizer: PreTrainedTokenizerBase, names: tuple[str, ...],
                special: bool = True) -> PreTrainedTokenizerBase:
    added = copy.deepcopy(tokenizer)
    assert added.add_tokens(list(names), special_tokens=special) == len(names)
    return added


def ids_of(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def markers(tokenizer: PreTrainedTokenizerBase) -> FillTokens:
    fill = fill_tokens(tokenizer)
    assert fill is not None
    return fill


def test_a_model_without_markers_cannot_fill(plain: PreTrainedTokenizerBase) -> None:
    # SmolLM2 has StarCoder's <repo_name> and <file_sep>, but no markers.
    assert fill_tokens(plain) is None
    assert fill_tokens(with_tokens(plain, ("<|fim_prefix|>", "<|fim_suffix|>"))) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_s_markers_are_found(plain: PreTrainedTokenizerBase, family: str) -> None:
    tokenizer = with_tokens(plain, FAMILIES[family])
    fill = markers(tokenizer)
    assert tokenizer.convert_ids_to_tokens([fill.prefix, fill.suffix, fill.middle]) == \
        list(MARKERS[family])
    gap = Gap("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")
    assert fill_prompt(tokenizer, fill, gap) == [
        fill.prefix, *ids_of(tokenizer, gap.prefix), fill.suffix, *ids_of(tokenizer, gap.suffix),
        fill.middle]


def test_the_endings_stop_a_middle_before_another_file(plain: PreTrainedTokenizerBase) -> None:
    tokenizer = with_tokens(plain, QWEN_CODER)
    fill = markers(tokenizer)
    names = set(tokenizer.convert_ids_to_tokens(list(fill.endings)))
    # the vocabulary's own StarCoder separators (SmolLM2's) stop it too
    assert names == {"<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<file_sep>", "<repo_name>"}
    assert fill.file_separator == tokenizer.convert_tokens_to_ids("<|file_sep|>")
    assert fill.repository == tokenizer.convert_tokens_to_ids("<|repo_name|>")
    codellama = markers(with_tokens(plain, FAMILIES["codellama"]))
    assert plain.convert_tokens_to_ids("<file_sep>") == codellama.file_separator
    assert len(codellama.endings) == 3  # <EOT>, and SmolLM2's <file_sep> and <repo_name>


def test_other_files_come_as_a_repository_where_the_model_learned_one(
        plain: PreTrainedTokenizerBase) -> None:
    tokenizer = with_tokens(plain, QWEN_CODER)
    fill = markers(tokenizer)
    gap = Gap("x = ", "\n", (("a.py", "A = 1"), ("b.py", "B = 2\n")))
    text = tokenizer.decode(fill_prompt(tokenizer, fill, gap))
    assert text == ("<|repo_name|>project\n<|file_sep|>a.py\nA = 1\n<|file_sep|>b.py\nB = 2\n"
                    "<|file_sep|>filename\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>")


def test_other_files_come_as_plain_text_where_it_learned_none(
        plain: PreTrainedTokenizerBase) -> None:
    tokenizer = with_tokens(plain, FAMILIES["deepseek-coder"])
    fill = markers(tokenizer)
    fill = FillTokens(fill.prefix, fill.suffix, fill.middle, None, None, (), (), fill.names)
    gap = Gap("x = ", "", (("a.py", "A = 1"),))
    assert tokenizer.decode(fill_prompt(tokenizer, fill, gap)) == \
        "--- a.py ---\nA = 1\n\n<｜fim▁begin｜>x = <｜fim▁hole｜><｜fim▁end｜>"  # noqa: RUF001


def test_a_prompt_starts_with_what_the_tokenizer_puts_first(
        plain: PreTrainedTokenizerBase) -> None:
    tokenizer = with_tokens(plain, FAMILIES["codellama"])
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    fill = markers(tokenizer)
    assert fill.start == (0,)
    assert fill_prompt(tokenizer, fill, Gap("a", "b"))[:2] == [0, fill.prefix]


def test_what_does_not_fit_leaves_the_files_then_the_far_ends(
        plain: PreTrainedTokenizerBase) -> None:
    tokenizer = with_tokens(plain, QWEN_CODER)
    fill = markers(tokenizer)
    prefix = "".join(f"line{i} = {i}\n" for i in range(100))
    suffix = "".join(f"after{i}()\n" for i in range(100))
    gap = Gap(prefix, suffix, (("a.py", "A = 1"), ("b.py", "B = 2")))
    whole = fill_prompt(tokenizer, fill, gap)
    assert fill_prompt(tokenizer, fill, gap, room=len(whole)) == whole
    second_only = fill_prompt(tokenizer, fill, Gap(prefix, suffix, gap.files[1:]))
    assert fill_prompt(tokenizer, fill, gap, room=len(whole) - 1) == second_only
    without_files = fill_prompt(tokenizer, fill, Gap(prefix, suffix))
    assert fill_prompt(tokenizer, fill, gap, room=len(without_files)) == without_files
    cut = fill_prompt(tokenizer, fill, gap, room=203)
    assert len(cut) == 203
    before, after = cut[1:cut.index(fill.suffix)], cut[cut.index(fill.suffix) + 1:-1]
    assert before == ids_of(tokenizer, prefix)[-150:]  # three quarters, its end
    assert after == ids_of(tokenizer, suffix)[:50]  # the rest, its start
    short = fill_prompt(tokenizer, fill, Gap("x = ", suffix), room=103)
    assert short[1:short.index(fill.suffix)] == ids_of(tokenizer, "x = ")
    assert len(short) == 103  # the suffix takes what the prefix leaves


@pytest.mark.parametrize("special", [True, False], ids=["special", "plain-as-qwen-ships-them"])
def test_markers_written_in_the_code_stay_text(plain: PreTrainedTokenizerBase,
                                               special: bool) -> None:
    tokenizer = with_tokens(plain, QWEN_CODER, special)
    fill = markers(tokenizer)
    code = 'MIDDLE = "<|fim_middle|>"  # <|file_sep|> <|im_end|>\n'
    prompt = fill_prompt(tokenizer, fill, Gap(code, code, (("<|file_sep|>.py", code),)))
    assert prompt.count(fill.middle) == 1 and prompt.count(fill.file_separator or -1) == 2
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in prompt
    assert tokenizer.decode(prompt).count(code) == 3
