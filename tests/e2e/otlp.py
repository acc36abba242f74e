"""An OTLP/HTTP trace receiver on loopback, as a collector would be: it decodes each export
(`ExportTraceServiceRequest`, protobuf) into `ReceivedSpan`s."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


class Receiver:
    """Every span exported to `url` so far, in arrival order."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def add(self, body: bytes) -> None:
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        with self.lock:
            self.spans += list(_spans(export))

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], what: str,
                 timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """The spans received, once `found` holds of them (they are exported in batches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: got {spans}"
            time.sleep(0.2)


def _spans(export: ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
    for resource_spans in export.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(),
                                   span.parent_span_id.hex(), _attributes(span.attributes),
                                   span.start_time_unix_nano, span.end_time_unix_nano)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiver serving POST /v1/traces on a free loopback port until the block ends."""
    receiver: Receiver | None = None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            assert receiver is not None
            receiver.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the test's output stays the test's

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
