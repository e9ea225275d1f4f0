"""Build the tracer provider a LeaseKit process exports lease spans with.

- Embedded default: an OTLP/JSON-lines file per process, ``<run_dir>/spans/<stem>-<pid>.jsonl``,
  written synchronously (SimpleSpanProcessor) so a killed process loses no finished span.
- OTLP: when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, also
  an OTLP exporter behind a BatchSpanProcessor. The protocol comes from
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf`` default,
  or ``grpc``), and the exporter reads endpoint, headers, timeout and TLS settings from the standard
  variables itself (OpenTelemetry specification, "OTLP Exporter Configuration").

A private provider is used (not the global one) so vLLM's own request tracing is left untouched.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Mapping

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from leasekit.telemetry.spanfile import OtlpJsonLinesSpanExporter

DEFAULT_SERVICE_NAME = "vllm-leasekit"
SUPPORTED_OTLP_PROTOCOLS = ("http/protobuf", "grpc")


class OsRandomIdGenerator(IdGenerator):
    """Trace and span ids from the OS's CSPRNG (``secrets``), not the ``random`` module.

    The SDK's default ``RandomIdGenerator`` draws from ``random``, which vLLM seeds (``seed=0``) in
    every engine process: P and D then produced the same sequence of trace and span ids (measured:
    both servers' first span had trace id ``e3e70682...``, ``random.seed(0)``'s first 128 bits), so
    spans of different requests collided across processes. W3C Trace Context requires random ids."""

    def generate_span_id(self) -> int:
        """A random non-zero 64-bit span id."""
        while True:
            value = secrets.randbits(64)
            if value:
                return value

    def generate_trace_id(self) -> int:
        """A random non-zero 128-bit trace id."""
        while True:
            value = secrets.randbits(128)
            if value:
                return value


class TelemetryConfigError(ValueError):
    """A telemetry setting (env var or run dir) is unusable; the message names it and the fix."""


def otlp_endpoint_configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTLP trace endpoint variables ask for OTLP export."""
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _otlp_exporter(env: Mapping[str, str]):
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise TelemetryConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc; "
                "fix: pip install opentelemetry-exporter-otlp-proto-grpc, or use http/protobuf"
            ) from exc
        return OTLPSpanExporter()
    raise TelemetryConfigError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported for traces; "
        f"allowed: {', '.join(SUPPORTED_OTLP_PROTOCOLS)}"
    )


def build_tracer_provider(
    *,
    run_dir: str | os.PathLike[str] | None,
    file_stem: str,
    resource_attributes: Mapping[str, str | int | float | bool],
    env: Mapping[str, str] = os.environ,
) -> tuple[TracerProvider, list[str]]:
    """Create a tracer provider with the embedded span file and, if configured, OTLP.

    Args:
        run_dir: directory whose ``spans/`` subdirectory receives this process's span file; None
            disables the file (then OTLP must be configured, or spans are dropped).
        file_stem: file name prefix, e.g. ``"kv_producer-<engine id>-tp0"``; the pid is appended.
        resource_attributes: extra resource attributes (engine id, TP rank, role). ``service.name``
            defaults to ``vllm-leasekit`` unless ``OTEL_SERVICE_NAME`` is set.
        env: the environment to read ``OTEL_*`` variables from.

    Returns:
        The provider and a list of human-readable sink descriptions (for the start-up log line).

    Raises:
        TelemetryConfigError: unsupported OTLP protocol, or the span file cannot be created.
    """
    attrs = dict(resource_attributes)
    if not env.get("OTEL_SERVICE_NAME"):
        attrs.setdefault(SERVICE_NAME, DEFAULT_SERVICE_NAME)
    provider = TracerProvider(resource=Resource.create(attrs), id_generator=OsRandomIdGenerator())
    sinks: list[str] = []
    if run_dir is not None:
        path = Path(run_dir) / "spans" / f"{file_stem}-{os.getpid()}.jsonl"
        try:
            exporter = OtlpJsonLinesSpanExporter(path)
        except OSError as exc:
            raise TelemetryConfigError(
                f"cannot create the span file {path}: {exc}; fix: set LEASEKIT_RUN_DIR (or "
                "kv_connector_extra_config.leasekit_run_dir) to a writable directory"
            ) from exc
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        sinks.append(f"file:{path}")
    if otlp_endpoint_configured(env):
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
        sinks.append(
            "otlp:" + (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
        )
    return provider, sinks
