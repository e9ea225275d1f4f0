"""Telemetry: OpenTelemetry lease spans, their exporters and readers.

Embedded default: one OTLP/JSON-lines span file per process under ``<run dir>/spans/`` (the format of
the OpenTelemetry Collector's file exporter). With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set, spans also go to OTLP, configured by the standard
``OTEL_EXPORTER_OTLP_*`` variables exactly as the OpenTelemetry SDK reads them.
"""
