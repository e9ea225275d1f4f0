"""Span files: an OTLP/JSON-lines span exporter and its reader.

Each line is one ``ExportTraceServiceRequest`` in the OTLP/JSON encoding (the protobuf JSON mapping
of ``opentelemetry/proto/collector/trace/v1/trace_service.proto``), the same format the OpenTelemetry
Collector's ``file`` exporter writes and its ``otlpjsonfile`` receiver reads. The encoding is done by
``opentelemetry-exporter-otlp-proto-common`` and ``protobuf``; nothing here re-implements it, except
one rule of the OTLP/JSON spec the generic protobuf JSON mapping does not follow: ``traceId``,
``spanId`` and ``parentSpanId`` are lower-case hex strings, not base64 (OTLP specification,
"JSON Protobuf Encoding"). The reader accepts both, for files written before that fix.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)


class OtlpJsonLinesSpanExporter(SpanExporter):
    """Append finished spans to ``path``, one OTLP/JSON ``ExportTraceServiceRequest`` per line.

    Each ``export`` call writes and flushes one line, so a process killed with SIGKILL loses at most
    the line being written (readers skip a torn last line). Thread-safe.

    Args:
        path: the file to append to; parent directories are created.

    Raises:
        OSError: the file cannot be created (at construction, so a bad run dir is refused at start).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write ``spans`` as one line; returns FAILURE (never raises) if the write fails."""
        if self._closed:
            return SpanExportResult.FAILURE
        try:
            message = _hex_ids(json_format.MessageToDict(encode_spans(spans)))
            line = json.dumps(message, separators=(",", ":")) + "\n"
            with self._lock:
                self._file.write(line)
                self._file.flush()
        except (OSError, ValueError) as exc:  # disk full, closed file, unencodable attribute
            logger.warning("leasekit: could not write %d span(s) to %s: %s", len(spans), self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the file; later exports return FAILURE."""
        with self._lock:
            self._closed = True
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Flush the file (every export already flushes)."""
        with self._lock:
            if not self._closed:
                self._file.flush()
        return True


@dataclass(frozen=True)
class SpanEvent:
    """One span event: ``name``, wall-clock ``time_unix_ns`` and decoded ``attributes``."""

    name: str
    time_unix_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class SpanRecord:
    """One finished span read back from a span file.

    Times are wall-clock nanoseconds since the epoch; ``attributes`` and ``resource`` hold decoded
    OTLP ``AnyValue`` values (str, int, float, bool, list).
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_unix_ns: int
    end_unix_ns: int
    attributes: dict[str, Any]
    events: tuple[SpanEvent, ...]
    resource: dict[str, Any]
    source: str = ""


@dataclass
class SpanReadResult:
    """Spans read from files, with the count of lines that could not be parsed (torn or corrupt)."""

    spans: list[SpanRecord] = field(default_factory=list)
    bad_lines: int = 0
    incomplete_tails: int = 0
    files: list[str] = field(default_factory=list)


def _any_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", []))
    return None


def _attributes(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _any_value(kv.get("value", {})) for kv in items}


_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Rewrite span and link ids of an ``ExportTraceServiceRequest`` dict from base64 to hex."""
    for resource_spans in message.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for item in (span, *span.get("links", [])):
                    for key in _ID_KEYS:
                        if item.get(key):
                            item[key] = _b64_to_hex(item[key])
    return message


def _id(value: str, hex_len: int) -> str:
    """An id as lower-case hex: hex as written by the OTLP/JSON spec, base64 from older files."""
    if not value or (len(value) == hex_len and all(c in "0123456789abcdefABCDEF" for c in value)):
        return value.lower()
    try:
        return _b64_to_hex(value)
    except (binascii.Error, ValueError):
        return value


def parse_line(line: str, source: str = "") -> list[SpanRecord]:
    """Decode one OTLP/JSON line into span records.

    Raises:
        ValueError: the line is not a JSON ``ExportTraceServiceRequest``.
    """
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("not an OTLP/JSON ExportTraceServiceRequest object")
    records: list[SpanRecord] = []
    for resource_spans in message.get("resourceSpans", []):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                records.append(
                    SpanRecord(
                        trace_id=_id(span.get("traceId", ""), 32),
                        span_id=_id(span.get("spanId", ""), 16),
                        parent_span_id=_id(span.get("parentSpanId", ""), 16),
                        name=span.get("name", ""),
                        start_unix_ns=int(span.get("startTimeUnixNano", 0)),
                        end_unix_ns=int(span.get("endTimeUnixNano", 0)),
                        attributes=_attributes(span.get("attributes", [])),
                        events=tuple(
                            SpanEvent(
                                name=ev.get("name", ""),
                                time_unix_ns=int(ev.get("timeUnixNano", 0)),
                                attributes=_attributes(ev.get("attributes", [])),
                            )
                            for ev in span.get("events", [])
                        ),
                        resource=resource,
                        source=source,
                    )
                )
    return records


def read_span_files(paths: Iterable[str | os.PathLike[str]]) -> SpanReadResult:
    """Read every span from OTLP/JSON-lines files; unparsable lines are counted, not raised.

    A last line without its newline is being written (or was torn by a kill): it is skipped and
    counted in ``incomplete_tails``, not in ``bad_lines``. Missing files and paths that cannot be
    read as files (a directory named ``*.jsonl``, no permission) are skipped.
    """
    result = SpanReadResult()
    for path in sorted(str(p) for p in paths):
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError:  # vanished, a directory, unreadable
            continue
        result.files.append(path)
        lines = text.split("\n")
        if lines and lines[-1].strip():
            result.incomplete_tails += 1
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                result.spans.extend(parse_line(line, source=path))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                result.bad_lines += 1
    return result


def read_span_dir(directory: str | os.PathLike[str]) -> SpanReadResult:
    """Read every ``*.jsonl`` span file directly under ``directory`` (see :func:`read_span_files`)."""
    return read_span_files(Path(directory).glob("*.jsonl"))
