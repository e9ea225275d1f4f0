"""A real OTLP/HTTP trace receiver for tests, built on opentelemetry-proto (DESIGN.md: no collector
is installable here): ``POST /v1/traces`` with an ``ExportTraceServiceRequest`` protobuf body."""

from __future__ import annotations

import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) in a daemon thread; ``received`` holds
    ``(path, content type, ExportTraceServiceRequest)`` per POST. Use as a context manager."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str | None, ExportTraceServiceRequest]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.received.append((self.path, self.headers.get("Content-Type"), request))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[tuple[str, str, dict]]:
        """Every received span as ``(name, trace id hex, {attribute: value})``."""
        out = []
        for _path, _ctype, request in list(self.received):
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value") or "string_value")
                                 for kv in span.attributes}
                        out.append((span.name, span.trace_id.hex(), attrs))
        return out
