"""Generation defaults: the request's values, else the model's generation_config.json, else
the config's generation_defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import GenerationDefaults, load_config
from gateway.chat_request import parse_chat_request
from gateway.defaults import resolve_defaults
from gateway.params import generation_params
from gateway.protocol import parse_completion_request

CONFIGURED = GenerationDefaults(temperature=0.3, top_p=0.8, top_k=10, min_p=0.02,
                                repetition_penalty=1.05, max_tokens=300)


def folder_with(tmp_path: Path, generation_config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_the_model_s_values_override_the_config_s(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                    "max_new_tokens": 512, "do_sample": True, "eos_token_id": 2})
    resolved = resolve_defaults(CONFIGURED, folder)
    assert resolved == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.02,
                                          repetition_penalty=1.05, max_tokens=512)


def test_ints_are_floats_where_floats_are_meant(tmp_path: Path) -> None:
    resolved = resolve_defaults(CONFIGURED, folder_with(tmp_path, {"temperature": 1}))
    assert resolved.temperature == 1.0 and isinstance(resolved.temperature, float)


@pytest.mark.parametrize("generation_config", [
    {"eos_token_id": 2, "pad_token_id": 2},  # SmolLM2's: no sampling values
    {"temperature": None},
])
def test_a_file_without_sampling_values_leaves_the_config_s(tmp_path: Path,
                                                            generation_config: object) -> None:
    assert resolve_defaults(CONFIGURED, folder_with(tmp_path, generation_config)) == CONFIGURED


@pytest.mark.parametrize("generation_config", [
    {"temperature": "hot"}, {"top_p": 3.0}, {"top_k": 1.5}, {"max_new_tokens": 0}, [1, 2],
])
def test_unusable_values_are_ignored(tmp_path: Path, generation_config: object) -> None:
    assert resolve_defaults(CONFIGURED, folder_with(tmp_path, generation_config)) == CONFIGURED


def test_no_file_or_from_model_off_leaves_the_config_s(tmp_path: Path) -> None:
    assert resolve_defaults(CONFIGURED, tmp_path) == CONFIGURED
    (tmp_path / "generation_config.json").write_text("{not json")
    assert resolve_defaults(CONFIGURED, tmp_path) == CONFIGURED
    folder = folder_with(tmp_path, {"temperature": 0.6})
    off = GenerationDefaults(from_model=False)
    assert resolve_defaults(off, folder) is off


def test_the_request_s_values_win_over_the_defaults() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "temperature": 0.9, "top_k": -1, "repeat_penalty": 1.2,
                       "max_tokens": 7}).encode()
    params = generation_params(parse_chat_request(body), CONFIGURED)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.9, 0.8, 0, 0.02)
    assert (params.repetition_penalty, params.max_tokens) == (1.2, 7)


def test_a_greedy_request_gets_no_default_repetition_penalty() -> None:
    def penalty(**fields: object) -> float:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           **fields}).encode()
        return generation_params(parse_chat_request(body), CONFIGURED).repetition_penalty

    assert penalty(temperature=0) == 1.0  # the model's own greedy output
    assert penalty() == penalty(temperature=0.7) == 1.05  # sampled: the default's
    assert penalty(temperature=0, repetition_penalty=1.3) == 1.3  # asked for: given


def test_the_cap_applies_to_requests_that_set_no_max_tokens() -> None:
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert generation_params(parse_chat_request(chat), CONFIGURED).default_max_tokens == 300
    text = {"model": "m", "prompt": "x"}
    completion = generation_params(parse_completion_request(json.dumps(text).encode()),
                                   CONFIGURED)
    assert completion.max_tokens == 16  # OpenAI's default for /v1/completions
    small = GenerationDefaults(max_tokens=8)
    assert generation_params(parse_completion_request(json.dumps(text).encode()),
                             small).max_tokens == 8
    null = json.dumps({**text, "max_tokens": None}).encode()
    assert generation_params(parse_completion_request(null), CONFIGURED).max_tokens is None


def test_the_default_yaml_matches_the_dataclass() -> None:
    path = Path(__file__).parents[2] / "configs/default.yaml"
    assert load_config(path).generation_defaults == GenerationDefaults()


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0},
                                 {"min_p": 2.0}, {"repetition_penalty": 0.0}])
def test_bad_configured_defaults_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="generation_defaults"):
        load_config(overrides={f"generation_defaults.{k}": v for k, v in bad.items()})
