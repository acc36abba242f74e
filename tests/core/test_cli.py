"""Command lines derived from the config: a flag per config key, typed as its field."""

from __future__ import annotations

import argparse

import pytest

from core.cli import ConfigParser
from core.config import KV_BACKENDS


def parsed(argv: list[str], *keys: str) -> tuple[ConfigParser, argparse.Namespace]:
    parser = ConfigParser("test", "a test")
    for key in keys:
        parser.config_flag(key)
    return parser, parser.parse_args(argv)


def test_shared_flags_set_their_keys() -> None:
    parser, args = parsed(["--model", "/m", "--control-address", "ipc:///c", "--kv-backend",
                           "zmq"])
    config = parser.config(args)
    assert config.model.name == "/m" and config.gateway.control_address == "ipc:///c"
    assert config.kv_transfer.backend == "zmq"


def test_a_flag_takes_its_type_and_help_from_the_field() -> None:
    parser, args = parsed(["--port", "9001", "--threads", "3"], "gateway.port",
                          "decode.threads")
    config = parser.config(args)
    assert config.gateway.port == 9001 and config.decode.threads == 3
    assert config.prefill.threads == 0  # another role's key: untouched
    assert "HTTP port" in parser.format_help()


def test_a_flag_of_a_choice_lists_it() -> None:
    parser, _ = parsed([])
    assert "{" + ",".join(("auto", *KV_BACKENDS)) + "}" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-backend", "rdma"])


def test_a_bad_value_exits_with_the_reason() -> None:
    parser, _ = parsed([], "gateway.port")
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "eighty"])
    with pytest.raises(SystemExit, match="config error"):
        parser.config(parser.parse_args(["--set", "decode.kv_bind=1", "--set",
                                          "prefill.kv_bind=x"]))


def test_set_overrides_any_key_and_flags_apply_too() -> None:
    parser, args = parsed(["--set", "decode.max_running=7", "--set", "prefill.prefix_caching=no",
                           "--port", "1"], "gateway.port")
    config = parser.config(args)
    assert config.decode.max_running == 7 and config.prefill.prefix_caching is False
    assert config.gateway.port == 1


def test_a_boolean_flag_reads_true_and_false() -> None:
    parser, args = parsed(["--prefix-caching", "false"], "prefill.prefix_caching")
    assert parser.config(args).prefill.prefix_caching is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-caching", "maybe"])


def test_a_flag_for_no_such_key_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="no config key"):
        ConfigParser("test", "a test").config_flag("gateway.nosuchkey")


def test_a_list_setting_takes_several_values() -> None:
    parser, args = parsed(["--served-model-name", "a", "b/c", "--strict-fields", "true"],
                          "gateway.served_model_name", "gateway.strict_fields")
    config = parser.config(args)
    assert config.gateway.served_model_name == ("a", "b/c") and config.gateway.strict_fields
    parser, args = parsed([], "gateway.served_model_name")
    assert parser.config(args).gateway.served_model_name == ()
