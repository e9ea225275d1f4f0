"""Telemetry sinks: the embedded span file, and OTLP/HTTP to a real receiver built on opentelemetry-proto."""

import http.server
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from leasekit.telemetry.provider import TelemetryConfigError, build_tracer_provider
from leasekit.telemetry.spanfile import read_span_dir


class _OtlpReceiver(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).received.append((self.path, self.headers.get("Content-Type"), request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    _OtlpReceiver.received = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_spans_go_to_the_run_dir_file_by_default(tmp_path):
    provider, sinks = build_tracer_provider(
        run_dir=tmp_path, file_stem="kv_producer-e1-tp0", resource_attributes={"leasekit.tp_rank": 0}, env={}
    )
    assert len(sinks) == 1 and sinks[0].startswith("file:")
    with provider.get_tracer("t").start_as_current_span("kv_lease"):
        pass
    provider.shutdown()
    spans = read_span_dir(tmp_path / "spans").spans
    assert [s.name for s in spans] == ["kv_lease"]
    assert spans[0].resource["service.name"] == "vllm-leasekit"
    assert spans[0].resource["leasekit.tp_rank"] == 0


def test_otlp_endpoint_sends_spans_over_otlp_http(tmp_path, receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}", "OTEL_SERVICE_NAME": "p-fleet"}
    # the exporter reads the standard variables from the process environment
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        provider, sinks = build_tracer_provider(run_dir=None, file_stem="x", resource_attributes={}, env=env)
        with provider.get_tracer("t").start_as_current_span("kv_lease") as span:
            span.set_attribute("gen_ai.request.id", "R1")
        provider.shutdown()  # flushes the batch processor
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert sinks == [f"otlp:http://127.0.0.1:{receiver.server_port}"]
    assert len(_OtlpReceiver.received) == 1
    path, content_type, request = _OtlpReceiver.received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    resource_spans = request.resource_spans[0]
    attrs = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    assert attrs["service.name"] == "p-fleet"  # OTEL_SERVICE_NAME wins over our default
    span = resource_spans.scope_spans[0].spans[0]
    assert span.name == "kv_lease"
    assert {kv.key: kv.value.string_value for kv in span.attributes}["gen_ai.request.id"] == "R1"


def test_unsupported_otlp_protocol_is_refused_with_the_allowed_values():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    with pytest.raises(TelemetryConfigError, match="http/protobuf, grpc"):
        build_tracer_provider(run_dir=None, file_stem="x", resource_attributes={}, env=env)


def test_unwritable_run_dir_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TelemetryConfigError, match="LEASEKIT_RUN_DIR"):
        build_tracer_provider(run_dir=blocker, file_stem="x", resource_attributes={}, env={})
