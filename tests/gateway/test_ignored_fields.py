"""Unknown request fields: found where they sit, logged once per name, counted, or refused."""

from __future__ import annotations

import json
import logging

import pytest

from gateway.chat_request import parse_chat_request
from gateway.errors import APIError
from gateway.ignored_fields import MAX_FIELD_LABELS, IgnoredFields, field_label, unknown_fields
from gateway.metrics import Metrics


def chat_body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


def counted(metrics: Metrics, label: str) -> float:
    value = metrics.registry.get_sample_value("raging_ignored_fields_total", {"field": label})
    return value or 0.0


def test_field_labels_drop_list_indices() -> None:
    assert field_label("messages[3].content[1].cache_control") == "messages.content.cache_control"
    assert field_label("typical_p") == "typical_p"


def test_each_name_is_logged_once_and_counted_each_time(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    ignored = IgnoredFields(metrics.ignored_fields, strict=False)
    request = parse_chat_request(chat_body(typical_p=0.9, messages=[
        {"role": "user", "content": "a", "x": 1}, {"role": "user", "content": "b", "x": 2}]))
    assert unknown_fields(request) == ["typical_p", "messages[0].x", "messages[1].x"]
    with caplog.at_level(logging.INFO, logger="gateway.ignored_fields"):
        ignored.check(request)
        ignored.check(request)
    assert counted(metrics, "typical_p") == 2 and counted(metrics, "messages.x") == 4
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and any("'typical_p'" in line for line in logged)


def test_labels_are_bounded() -> None:
    metrics = Metrics()
    ignored = IgnoredFields(metrics.ignored_fields, strict=False)
    for index in range(MAX_FIELD_LABELS + 5):
        ignored.check(parse_chat_request(chat_body(**{f"f{index}": 1})))
    assert counted(metrics, "other") == 5
    assert counted(metrics, f"f{MAX_FIELD_LABELS - 1}") == 1
    assert counted(metrics, f"f{MAX_FIELD_LABELS}") == 0


def test_strict_mode_refuses_the_first_with_openai_wording() -> None:
    metrics = Metrics()
    strict = IgnoredFields(metrics.ignored_fields, strict=True)
    with pytest.raises(APIError) as info:
        strict.check(parse_chat_request(chat_body(stream=True, stream_options={
            "include_usage": True, "cached_usage_stats": True}, zzz=1)))
    assert info.value.status == 400
    assert info.value.message == "Unrecognized request argument supplied: zzz"
    assert info.value.param == "zzz"
    strict.check(parse_chat_request(chat_body(min_p=0.1)))  # known fields pass
    assert counted(metrics, "zzz") == 0
