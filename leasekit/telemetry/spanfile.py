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

    Each ``export`` call appends one line with ``os.write`` on an ``O_APPEND`` descriptor (no
    user-space buffer, so nothing waits in this process once ``export`` returns; a SIGKILL loses at
    most the line being written, which readers skip). Behind :class:`BatchSpanProcessor` one line
    holds one batch. A write that fails part-way (ENOSPC) leaves a partial line; the next line then
    starts with a newline, so the partial one reads as one bad line and later lines stay readable.
    Failures are logged once per run of failures, not once per export. Thread-safe.

    Args:
        path: the file to append to; parent directories are created.
        close_timeout_s: seconds :meth:`shutdown` waits for a write in progress (a frozen
            filesystem) before it gives up closing the file.

    Raises:
        OSError: the file cannot be created (at construction, so a bad run dir is refused at start).
    """

    def __init__(self, path: str | os.PathLike[str], *, close_timeout_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        self._lock = threading.Lock()
        self._closed = False
        self._torn = False  # the last write failed: the file may end in a partial line
        self._failed_exports = self._failed_spans = 0  # in the current run of failures
        self.close_timeout_s = close_timeout_s

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write ``spans`` as one line; returns FAILURE (never raises) if encoding or the write fails.
        Blocks as long as the write does (a frozen filesystem): call it off the engine thread."""
        if self._closed:
            return SpanExportResult.FAILURE
        try:
            message = _hex_ids(json_format.MessageToDict(encode_spans(spans)))
            data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        except (ValueError, TypeError) as exc:  # an unencodable attribute
            logger.warning("leasekit: could not encode %d span(s) for %s: %s", len(spans), self.path, exc)
            return SpanExportResult.FAILURE
        with self._lock:
            if self._closed or self._fd is None:
                return SpanExportResult.FAILURE
            try:
                _write_all(self._fd, b"\n" + data if self._torn else data)
            except OSError as exc:  # disk full, I/O error
                self._torn = True
                self._failed_exports += 1
                self._failed_spans += len(spans)
                if self._failed_exports == 1:
                    logger.warning("leasekit: could not write %d span(s) to %s: %s; further failures are "
                                   "not logged until a write succeeds", len(spans), self.path, exc)
                return SpanExportResult.FAILURE
            self._torn = False
            if self._failed_exports:
                logger.warning("leasekit: writing spans to %s again; %d span(s) in %d export(s) were lost",
                               self.path, self._failed_spans, self._failed_exports)
                self._failed_exports = self._failed_spans = 0
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the file; later exports return FAILURE. If a write is still blocked after
        ``close_timeout_s`` seconds the file is left open (logged). Never raises."""
        self._closed = True
        if not self._lock.acquire(timeout=self.close_timeout_s):
            logger.warning("leasekit: a span write to %s is still blocked after %.1f s; not closing it",
                           self.path, self.close_timeout_s)
            return
        try:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        except OSError as exc:
            logger.warning("leasekit: closing %s: %s", self.path, exc)
        finally:
            self._lock.release()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing to do: ``export`` keeps no buffer in this process. Returns True."""
        return True


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a regular file may take a short write).

    Raises:
        OSError: the write failed (ENOSPC, EIO, EPIPE) or wrote nothing.
    """
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(f"write returned {written}")
        view = view[written:]


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
