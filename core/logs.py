"""Process logging: text lines for people, or one JSON object a line for log collectors.

A log line about a request names it with `extra=about(key)`: JSON lines then carry its
`request_id` and `epoch` as fields, so that one request's lines can be followed across the
gateway and its workers."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from core.config import LogFormat
from core.messages import RequestKey

REQUEST_FIELDS = ("request_id", "epoch")


def about(key: RequestKey) -> dict[str, object]:
    """The `extra=` of a log line about one epoch of one request."""
    return {"request_id": key.request_id, "epoch": key.epoch}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, process (the gateway
    or the worker id), message, the request's fields when the record names one, and any
    exception's traceback."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "process": self.process,
            "message": record.getMessage(),
        }
        line.update({name: getattr(record, name) for name in REQUEST_FIELDS
                     if hasattr(record, name)})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup_logging(process: str, log_format: LogFormat = "text") -> None:
    """Log INFO and up to stderr as `log_format`, each line naming `process`; warnings too."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.captureWarnings(True)
