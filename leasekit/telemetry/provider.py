"""Build the tracer provider a LeaseKit process exports lease spans with.

- Embedded default: an OTLP/JSON-lines file per process, ``<run_dir>/spans/<stem>-<pid>.jsonl``.
- OTLP: when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, also
  an OTLP exporter. The protocol comes from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf`` default, or ``grpc``), and the exporter reads
  endpoint, headers, timeout and TLS settings from the standard variables itself (OpenTelemetry
  specification, "OTLP Exporter Configuration").

Each sink sits behind its own OpenTelemetry SDK ``BatchSpanProcessor``
(:class:`~leasekit.telemetry.batching.CountingBatchSpanProcessor`): ending a span on vLLM's engine
thread only records it and appends it to a bounded queue; a background thread encodes and writes it.
A full queue drops the span and counts it (:meth:`LeaseKitTracerProvider.dropped_spans`); a slow,
full or frozen disk or a hanging OTLP endpoint only ever blocks the background thread.

- Span file: queue 2048 spans, batches of up to 512, written every 0.2 s (at once when 512 wait).
- OTLP: the standard ``OTEL_BSP_SCHEDULE_DELAY`` (ms, default 5000), ``OTEL_BSP_MAX_QUEUE_SIZE``
  (2048), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (512), ``OTEL_BSP_EXPORT_TIMEOUT`` (ms, 30000).

What a process loses: ``provider.shutdown()`` (vLLM's worker shutdown calls the connector's
``shutdown`` on SIGTERM or a normal stop; the SDK also registers it with ``atexit``) exports what is
queued, waiting at most 2 s for the span file and at most the OTLP exporter's timeout
(``OTEL_EXPORTER_OTLP_TIMEOUT``, seconds, default 10) for OTLP; what is still queued then is counted
as dropped. A SIGKILL loses what is queued: the spans that ended in the last schedule delay (about
0.2 s for the span file), the batch being written (its torn line is skipped by readers), everything
queued behind a slow or blocked write, and, as before, every span still open.

A private provider is used (not the global one) so vLLM's own request tracing is left untouched.
"""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path
from typing import Mapping

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from leasekit.telemetry.batching import BatchSettings, CountingBatchSpanProcessor, SpanExportCounts
from leasekit.telemetry.spanfile import OtlpJsonLinesSpanExporter

DEFAULT_SERVICE_NAME = "vllm-leasekit"
RESOURCE_ENV = ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS")
"""The environment variables OpenTelemetry's resource detectors read (``Resource.create``)."""
_DETECTED: dict[tuple[str | None, ...], Resource] = {}
SUPPORTED_OTLP_PROTOCOLS = ("http/protobuf", "grpc")
SPAN_FILE_BATCH = BatchSettings(max_queue_size=2048, schedule_delay_s=0.2, max_export_batch_size=512,
                                export_timeout_s=30.0, shutdown_timeout_s=2.0)
"""The span file's batching. The 0.2 s delay (the SDK's default is 5 s) bounds what a SIGKILLed process
loses while writes keep up: the spans of its last ~0.2 s. 2048 queued spans at most (the SDK default)."""


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


class LeaseKitTracerProvider(TracerProvider):
    """The SDK's ``TracerProvider`` that also reports what became of the spans of each sink.

    The connector puts :meth:`dropped_spans` (and :meth:`failed_spans`) on ``/metrics``; both are
    cheap (one lock per sink, no I/O) and safe to call from the engine thread every step.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._leasekit_processors: list[CountingBatchSpanProcessor] = []

    def add_batch_processor(self, processor: CountingBatchSpanProcessor) -> None:
        """Register ``processor`` as a span processor and count its spans."""
        self._leasekit_processors.append(processor)
        self.add_span_processor(processor)

    def span_export_counts(self) -> dict[str, SpanExportCounts]:
        """Counts per sink (``"file"``, ``"otlp"``), in spans, since start (see :class:`SpanExportCounts`)."""
        return {p.sink: p.counts() for p in self._leasekit_processors}

    def dropped_spans(self) -> int:
        """Spans never handed to any exporter, summed over sinks: the queue was full, or shutdown
        began (or gave up waiting). Monotonic; for a ``leasekit_spans_dropped_total`` counter."""
        return sum(p.counts().dropped for p in self._leasekit_processors)

    def failed_spans(self) -> int:
        """Spans in export calls that failed (write error, disk full, OTLP error or timeout), summed
        over sinks. Monotonic."""
        return sum(p.counts().failed for p in self._leasekit_processors)


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


def _env_number(env: Mapping[str, str], name: str, default: float, *, integer: bool) -> float:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = 0
    if not (value > 0 and math.isfinite(value)):
        kind = "an integer >= 1" if integer else "a number > 0"
        raise TelemetryConfigError(f"{name}={raw!r}: must be {kind}")
    return value


def otlp_batch_settings(env: Mapping[str, str] = os.environ) -> BatchSettings:
    """The OTLP sink's batching from the standard ``OTEL_BSP_*`` variables (milliseconds; OpenTelemetry
    specification, "Batch Span Processor"; defaults 5000, 2048, 512, 30000; SDK 1.45 does not use the
    export timeout) and the shutdown wait from
    the exporter's own timeout, ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` / ``OTEL_EXPORTER_OTLP_TIMEOUT``
    (seconds, as the Python OTLP exporters read it; default 10).

    Raises:
        TelemetryConfigError: a variable is not a positive number, or the batch size exceeds the queue.
    """
    queue = int(_env_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048, integer=True))
    batch = int(_env_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, integer=True))
    if batch > queue:
        raise TelemetryConfigError(f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={batch}: must be <= OTEL_BSP_MAX_QUEUE_SIZE ({queue})")
    timeout_name = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" if env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") else "OTEL_EXPORTER_OTLP_TIMEOUT"
    return BatchSettings(
        max_queue_size=queue,
        schedule_delay_s=_env_number(env, "OTEL_BSP_SCHEDULE_DELAY", 5000, integer=False) / 1000.0,
        max_export_batch_size=batch,
        export_timeout_s=_env_number(env, "OTEL_BSP_EXPORT_TIMEOUT", 30000, integer=False) / 1000.0,
        shutdown_timeout_s=_env_number(env, timeout_name, 10.0, integer=False),
    )


def detected_resource() -> Resource:
    """OpenTelemetry's resource for this process, ``Resource.create({})`` (the SDK's defaults, then its
    detectors: ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``, ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``),
    run once per value of those variables and kept: the SDK runs detectors on a thread pool and waits
    up to 5 s for each, which every TP worker of a process would otherwise pay again.
    ``detected_resource().merge(Resource(attrs))`` equals ``Resource.create(attrs)`` whenever ``attrs``
    names ``service.name`` or ``OTEL_SERVICE_NAME`` is set (as :func:`build_tracer_provider` ensures)."""
    key = tuple(os.environ.get(name) for name in RESOURCE_ENV)
    resource = _DETECTED.get(key)
    if resource is None:
        resource = _DETECTED[key] = Resource.create({})
    return resource


def build_tracer_provider(
    *,
    run_dir: str | os.PathLike[str] | None,
    file_stem: str,
    resource_attributes: Mapping[str, str | int | float | bool],
    env: Mapping[str, str] = os.environ,
) -> tuple[LeaseKitTracerProvider, list[str]]:
    """Create a tracer provider with the embedded span file and, if configured, OTLP, each behind a
    counting ``BatchSpanProcessor`` (the file first, so its flush at shutdown never waits for OTLP).

    Args:
        run_dir: directory whose ``spans/`` subdirectory receives this process's span file; None
            disables the file (then OTLP must be configured, or spans are dropped).
        file_stem: file name prefix, e.g. ``"kv_producer-<engine id>-tp0"``; the pid is appended.
        resource_attributes: extra resource attributes (engine id, TP rank, role). ``service.name``
            defaults to ``vllm-leasekit`` unless ``OTEL_SERVICE_NAME`` is set.
        env: the environment to read ``OTEL_*`` variables from.

    Returns:
        The provider (a ``TracerProvider`` with :meth:`~LeaseKitTracerProvider.dropped_spans`,
        :meth:`~LeaseKitTracerProvider.failed_spans` and
        :meth:`~LeaseKitTracerProvider.span_export_counts`) and a list of human-readable sink
        descriptions (for the start-up log line).

    Raises:
        TelemetryConfigError: unsupported OTLP protocol, an ``OTEL_BSP_*`` or OTLP timeout variable
            out of range, or the span file cannot be created.
    """
    attrs = dict(resource_attributes)
    if not env.get("OTEL_SERVICE_NAME"):
        attrs.setdefault(SERVICE_NAME, DEFAULT_SERVICE_NAME)
    otlp = otlp_endpoint_configured(env)
    otlp_batch = otlp_batch_settings(env) if otlp else None  # refuse bad settings before opening anything
    otlp_exporter = _otlp_exporter(env) if otlp else None
    provider = LeaseKitTracerProvider(resource=detected_resource().merge(Resource(attrs)),
                                      id_generator=OsRandomIdGenerator())
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
        provider.add_batch_processor(CountingBatchSpanProcessor(exporter, sink="file", settings=SPAN_FILE_BATCH))
        sinks.append(f"file:{path}")
    if otlp_exporter is not None and otlp_batch is not None:
        provider.add_batch_processor(CountingBatchSpanProcessor(otlp_exporter, sink="otlp", settings=otlp_batch))
        sinks.append(
            "otlp:" + (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
        )
    return provider, sinks
