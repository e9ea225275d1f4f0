"""Telemetry sinks: the embedded span file, and OTLP/HTTP to a real receiver built on opentelemetry-proto."""

import pytest

from leasekit.telemetry.provider import TelemetryConfigError, build_tracer_provider
from leasekit.telemetry.spanfile import read_span_dir
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver():
    with OtlpReceiver() as started:
        yield started


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
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_SERVICE_NAME": "p-fleet"}
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
    assert sinks == [f"otlp:http://127.0.0.1:{receiver.port}"]
    assert len(receiver.received) == 1
    path, content_type, request = receiver.received[0]
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


def test_span_ids_do_not_follow_the_seeded_random_module(tmp_path):
    """vLLM seeds ``random`` identically in every engine process; two processes' providers must
    still produce different ids (the SDK default drew them from ``random``)."""
    import random

    ids = []
    for _ in range(2):
        random.seed(0)
        provider, _sinks = build_tracer_provider(run_dir=None, file_stem="x", resource_attributes={}, env={})
        span = provider.get_tracer("t").start_span("s")
        ids.append((span.get_span_context().trace_id, span.get_span_context().span_id))
        span.end()
    assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1]
    random.seed(0)
    assert ids[0][0] != random.getrandbits(128)


def test_the_resource_detectors_run_once_per_environment(monkeypatch):
    """Each TP worker builds a provider; OpenTelemetry's detectors (a thread pool, up to 5 s each) run once
    per value of the variables they read, and the resource equals ``Resource.create`` of the same attributes."""
    from opentelemetry.sdk.resources import Resource

    import leasekit.telemetry.provider as prov

    calls = []
    real = Resource.create
    monkeypatch.setattr(prov, "_DETECTED", {})
    monkeypatch.setattr(prov.Resource, "create", staticmethod(lambda attrs=None, schema_url=None: calls.append(1) or real(attrs, schema_url)))
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=p-0")
    attrs = {"leasekit.tp_rank": 1, "service.name": "vllm-leasekit"}
    first = build_tracer_provider(run_dir=None, file_stem="x", resource_attributes=attrs, env={})[0].resource
    second = build_tracer_provider(run_dir=None, file_stem="x", resource_attributes=attrs, env={})[0].resource
    assert len(calls) == 1 and first.attributes == second.attributes == real(attrs).attributes
    assert first.attributes["k8s.pod.name"] == "p-0" and first.attributes["leasekit.tp_rank"] == 1
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pd-fleet")  # a new environment: detected again
    third = build_tracer_provider(run_dir=None, file_stem="x", resource_attributes={}, env={"OTEL_SERVICE_NAME": "pd-fleet"})[0]
    assert len(calls) == 2 and third.resource.attributes["service.name"] == "pd-fleet"
