"""Process logging: JSON lines carry the process, and a request's id and epoch when the line
names one; text stays text; the --log-format flag sets it for every process."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest

from core.cli import ConfigParser
from core.logs import JsonFormatter, about, setup_logging
from core.messages import RequestKey


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level
    logging.captureWarnings(False)


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("prefill.worker", logging.INFO, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


def test_a_json_line_has_the_fields_and_the_request() -> None:
    line = json.loads(JsonFormatter("prefill-0").format(
        record("request %s: %d prompt tokens", "r1", 12, **about(RequestKey("r1", 2)))))
    assert line.pop("time").endswith("+00:00")
    assert line == {"level": "INFO", "logger": "prefill.worker", "process": "prefill-0",
                    "message": "request r1: 12 prompt tokens", "request_id": "r1", "epoch": 2}


def test_a_line_about_no_request_has_no_request_fields() -> None:
    line = json.loads(JsonFormatter("gateway").format(record('quotes " and\nnewlines')))
    assert line["message"] == 'quotes " and\nnewlines' and "request_id" not in line


def test_an_exception_stays_inside_its_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        failed = record("failed")
        failed.exc_info = sys.exc_info()
    text = JsonFormatter("decode-0").format(failed)
    assert "\n" not in text and "ValueError: boom" in json.loads(text)["exception"]


def test_setup_logging_json_writes_one_object_a_line(
        restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("decode-3", "json")
    logging.getLogger("decode.worker").info("finished", extra=about(RequestKey("r9", 0)))
    logging.getLogger("other").warning("plain")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["process"], line.get("request_id"), line["level"]) for line in lines] == [
        ("decode-3", "r9", "INFO"), ("decode-3", None, "WARNING")]


def test_text_is_the_default(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("gateway")
    logging.getLogger("gateway.dispatch").info("hello")
    assert capsys.readouterr().err.rstrip().endswith("gateway INFO gateway.dispatch: hello")


def test_every_process_takes_the_log_format_flag() -> None:
    parser = ConfigParser("python -m decode", "test")
    assert parser.config(parser.parse_args(["--log-format", "json"])).logging.format == "json"
    assert parser.config(parser.parse_args([])).logging.format == "text"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
