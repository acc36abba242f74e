"""Configuration: defaults, the shipped YAML, dotted overrides, and type checking."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core.config import (
    KV_BACKENDS,
    AuthConfig,
    Config,
    DecodeConfig,
    GatewayConfig,
    ModelConfig,
    PrefillConfig,
    config_field,
    load_config,
    sim_profile_of,
)

DEFAULT_YAML = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_load_without_a_file() -> None:
    config = load_config()
    assert config == Config()
    assert config.gateway == GatewayConfig() and config.model == ModelConfig()
    assert config.decode == DecodeConfig() and config.prefill == PrefillConfig()


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config().gateway.port = 1  # type: ignore[misc]


def test_default_yaml_loads_with_its_values() -> None:
    config = load_config(DEFAULT_YAML)
    assert config.model.max_model_len == 8192
    assert config.prefill.num_kv_blocks == 640 and config.prefill.threads == 0
    assert config.decode.num_kv_blocks == 1024 and config.decode.max_running == 64
    assert config.gateway.heartbeat_timeout_s == 2.5
    assert config.prefill.heartbeat_interval_s == PrefillConfig().heartbeat_interval_s


def test_an_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "# nothing here\n")) == Config()


def test_partial_file_keeps_other_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "gateway:\n  port: 9000\n"))
    assert config.gateway.port == 9000
    assert config.gateway.host == GatewayConfig().host and config.decode == DecodeConfig()


def test_int_override() -> None:
    config = load_config(overrides={"gateway.port": "8080", "decode.num_kv_blocks": "12"})
    assert config.gateway.port == 8080 and type(config.gateway.port) is int
    assert config.decode.num_kv_blocks == 12 and config.prefill.num_kv_blocks == 4096


def test_float_override_from_an_int() -> None:
    config = load_config(overrides={"gateway.heartbeat_timeout_s": "5"})
    assert config.gateway.heartbeat_timeout_s == 5.0
    assert type(config.gateway.heartbeat_timeout_s) is float
    assert load_config(overrides={"gateway.keepalive_s": "0.25"}).gateway.keepalive_s == 0.25


def test_str_override() -> None:
    config = load_config(overrides={"gateway.control_address": "ipc:///tmp/ctl"})
    assert config.gateway.control_address == "ipc:///tmp/ctl"


@pytest.mark.parametrize("text", ["123", "yes", "true", "~", "null", "1.5", "[a"])
def test_str_override_keeps_its_text(text: str) -> None:
    assert load_config(overrides={"model.name": text}).model.name == text


def test_overrides_apply_on_top_of_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  port: 9000\n  host: 0.0.0.0\n")
    config = load_config(path, {"gateway.port": "9001"})
    assert config.gateway.port == 9001 and config.gateway.host == "0.0.0.0"


@pytest.mark.parametrize("value", ["true", "false", "yes"])
def test_bool_override_is_not_an_int(value: str) -> None:
    with pytest.raises(ValueError, match=r"gateway\.port"):
        load_config(overrides={"gateway.port": value})


@pytest.mark.parametrize("dotted", ["nosuchsection.port", "gateway.nosuchkey"])
def test_unknown_override_names_it(dotted: str) -> None:
    with pytest.raises(ValueError, match="nosuch"):
        load_config(overrides={dotted: "1"})


def test_quant_rows_are_measured_never_or_a_count() -> None:
    assert load_config().model.quant_rows == -1
    assert load_config(overrides={"model.quant_rows": "0"}).model.quant_rows == 0
    with pytest.raises(ValueError, match="quant_rows"):
        load_config(overrides={"model.quant_rows": "-2"})


@pytest.mark.parametrize("value", ["0", "-1", ".inf", ".nan", "1e12"])
def test_the_turn_patience_is_a_finite_positive_wait(value: str) -> None:
    """Forever cannot be a timed wait's timeout (threading's raises past TIMEOUT_MAX)."""
    assert load_config(overrides={"engine.cpu_turn_patience_s": "600"}).engine \
        .cpu_turn_patience_s == 600
    with pytest.raises(ValueError, match="cpu_turn_patience_s"):
        load_config(overrides={"engine.cpu_turn_patience_s": value})


@pytest.mark.parametrize("value", ["0", "-1", ".inf", ".nan"])
def test_the_autoscaler_polls_at_a_finite_positive_interval(value: str) -> None:
    assert load_config().autoscale.poll_s == 2.0
    assert load_config(overrides={"autoscale.poll_s": "0.5"}).autoscale.poll_s == 0.5
    with pytest.raises(ValueError, match="poll_s"):
        load_config(overrides={"autoscale.poll_s": value})


def test_override_without_a_dot_is_refused() -> None:
    with pytest.raises(ValueError, match="port"):
        load_config(overrides={"port": "1"})


def test_unknown_section_or_key_in_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sidecar"):
        load_config(write(tmp_path, "sidecar:\n  port: 1\n"))
    with pytest.raises(ValueError, match="num_blocks"):
        load_config(write(tmp_path, "decode:\n  num_blocks: 1\n"))


@pytest.mark.parametrize(("dotted", "value"), [
    ("gateway.port", "abc"),
    ("gateway.port", "1.5"),  # float where int
    ("gateway.port", "~"),  # None where int
    ("gateway.heartbeat_timeout_s", "soon"),
    ("gateway.heartbeat_timeout_s", "true"),
    ("decode.max_running", "[1, 2]"),
    ("decode.max_running", "{a: 1}"),
    ("decode.max_running", "[1"),  # not even YAML
])
def test_wrong_type_override_raises_value_error(dotted: str, value: str) -> None:
    with pytest.raises(ValueError, match=dotted.split(".")[1]):
        load_config(overrides={dotted: value})


@pytest.mark.parametrize("text", [
    "gateway:\n  port: '8000'\n",  # str where int
    "gateway: 5\n",  # a section that is not a mapping
    "- gateway\n",  # top level that is not a mapping
    "model:\n  name: 5\n",  # int where str
    "gateway: [port\n",  # not YAML
])
def test_wrong_shapes_in_file_raise_value_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError):
        load_config(write(tmp_path, text))


def test_override_into_a_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gateway"):
        load_config(write(tmp_path, "gateway: 5\n"), {"gateway.port": "1"})


def test_auth_is_off_by_default() -> None:
    assert load_config().auth == AuthConfig() and AuthConfig().api_keys == ()
    assert load_config(DEFAULT_YAML).auth == AuthConfig()


def test_auth_keys_and_file_from_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "auth:\n  api_keys: [sk-a:alpha, sk-b]\n  keys_file: /etc/keys\n")
    auth = load_config(path).auth
    assert auth.api_keys == ("sk-a:alpha", "sk-b") and auth.keys_file == "/etc/keys"
    assert load_config(write(tmp_path, "auth:\n  api_keys:\n")).auth.api_keys == ()


def test_auth_keys_override_is_a_yaml_list() -> None:
    config = load_config(overrides={"auth.api_keys": "[sk-a:alpha, sk-b:beta]"})
    assert config.auth.api_keys == ("sk-a:alpha", "sk-b:beta")


@pytest.mark.parametrize("text", [
    "auth:\n  api_keys: sk-secret\n",  # a string, not a list
    "auth:\n  api_keys: [sk-secret, 12345]\n",  # a number where a key should be
    "auth:\n  api_keys: [{sk-secret: alpha}]\n",  # a mapping where a key should be
])
def test_wrong_auth_keys_are_refused_without_quoting_them(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError, match=r"config\.auth\.api_keys: expected a list of str") as e:
        load_config(write(tmp_path, text))
    assert "secret" not in str(e.value) and "12345" not in str(e.value)


def test_keys_stay_out_of_the_config_repr() -> None:
    config = load_config(overrides={"auth.api_keys": "[sk-secret:alpha]"})
    assert "sk-secret" not in repr(config) and "sk-secret" not in str(config.auth)


@pytest.mark.parametrize(("dotted", "why"), [
    ("prefill.kv_bind", "decode workers receive KV; prefill workers bind nothing"),
    ("prefill.max_running", "a decode batch's bound"),
    ("decode.max_batch_tokens", "a prefill step's budget"),
    ("decode.prefix_caching", "prefill workers keep the prefix cache"),
])
def test_a_key_of_the_other_role_is_refused(dotted: str, why: str) -> None:
    with pytest.raises(ValueError, match=dotted.split(".")[1]):
        load_config(overrides={dotted: "1"})


def test_the_pool_of_each_role() -> None:
    config = load_config(overrides={"prefill.threads": "3", "decode.threads": "5"})
    assert config.pool("prefill").threads == 3 and config.pool("decode").threads == 5


@pytest.mark.parametrize("backend", KV_BACKENDS)
def test_a_named_choice_is_taken(backend: str) -> None:
    assert load_config(overrides={"kv_transfer.backend": backend}).kv_transfer.backend == backend


@pytest.mark.parametrize(("dotted", "value"), [("kv_transfer.backend", "rdma"),
                                               ("model.dtype", "fp8")])
def test_a_choice_outside_its_list_is_refused_with_the_list(dotted: str, value: str) -> None:
    with pytest.raises(ValueError, match=r"expected one of \["):
        load_config(overrides={dotted: value})


def test_a_choice_takes_its_text_as_is() -> None:
    with pytest.raises(ValueError, match="'1'"):  # not the int 1: choices are text
        load_config(overrides={"kv_transfer.backend": "1"})


def test_every_setting_says_what_it_means() -> None:
    for section in dataclasses.fields(Config):
        for setting in dataclasses.fields(section.type if isinstance(section.type, type)
                                          else getattr(Config(), section.name)):
            config, _ = config_field(f"{section.name}.{setting.name}")
            assert config.metadata.get("help"), f"{section.name}.{setting.name} has no help"


def test_routing_packs_by_default_and_may_spread() -> None:
    gateway = load_config().gateway
    assert (gateway.decode_routing, gateway.prefill_routing) == ("pack", "pack")
    spread = load_config(overrides={"gateway.decode_routing": "spread"}).gateway
    assert spread.decode_routing == "spread" and spread.prefill_routing == "pack"


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1"])
def test_pack_kv_fraction_is_a_share_of_the_kv(fraction: str) -> None:
    with pytest.raises(ValueError, match="pack_kv_fraction"):
        load_config(overrides={"gateway.pack_kv_fraction": fraction})


def test_a_simulated_model_is_named_with_its_profile() -> None:
    assert ModelConfig(name="sim").sim_profile == "default"
    assert ModelConfig(name="sim:llama-8b").sim_profile == "llama-8b"
    assert ModelConfig().sim_profile is None and sim_profile_of("simple") is None
    with pytest.raises(ValueError, match="profile after the colon"):
        ModelConfig(name="sim:")
    bads: list[dict[str, object]] = [{"sim.kv_bytes": 0}, {"sim.kv_bytes": 1.5},
                                     {"sim.time_scale": -1}]
    for bad in bads:
        with pytest.raises(ValueError, match=r"sim\.kv_bytes"):
            load_config(None, bad)
    assert load_config(None, {"sim.kv_bytes": "0.25"}).sim.kv_bytes == 0.25
