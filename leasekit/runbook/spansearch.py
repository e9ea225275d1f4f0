"""Finding the spans of one request in a run directory: the I/O half of ``leasekit explain``.

Span files are the embedded default sink of docs/telemetry.md ("Where spans go"):
``<run dir>/spans/*.jsonl``, one OTLP/JSON ``ExportTraceServiceRequest`` per line. Chaos runs put
each pair in its own subdirectory, so every ``spans/`` directory below the run dir is searched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from leasekit.telemetry import semconv as sc
from leasekit.telemetry.spanfile import SpanRecord, read_span_files

DEFAULT_RUN_DIR = "leasekit-run"
"""The run dir when neither ``--run-dir`` nor ``$LEASEKIT_RUN_DIR`` is given (as the connector's
default, docs/telemetry.md)."""


def default_run_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$LEASEKIT_RUN_DIR`` if set and non-empty, else ``./leasekit-run``."""
    return Path(env.get("LEASEKIT_RUN_DIR") or DEFAULT_RUN_DIR)


def find_span_dirs(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Every directory named ``spans`` at or below ``run_dir`` (symlinks not followed), plus
    ``run_dir`` itself if it holds ``*.jsonl`` files directly; sorted, no duplicates.

    Returns [] when ``run_dir`` does not exist.
    """
    root = Path(run_dir)
    found: set[Path] = set()
    if root.name == "spans" and root.is_dir():
        found.add(root)
    if root.is_dir() and any(root.glob("*.jsonl")):
        found.add(root)
    for dirpath, dirnames, _ in os.walk(root, followlinks=False):
        if "spans" in dirnames:
            found.add(Path(dirpath) / "spans")
    return sorted(found)


@dataclass
class SpanSearch:
    """Every span under a run dir.

    Attributes:
        run_dir: the directory searched.
        span_dirs: the ``spans/`` directories found (see :func:`find_span_dirs`).
        files: span files read.
        spans: every span read.
        bad_lines: unparsable lines skipped; incomplete_tails: torn last lines skipped.
    """

    run_dir: Path
    span_dirs: list[Path] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    spans: list[SpanRecord] = field(default_factory=list)
    bad_lines: int = 0
    incomplete_tails: int = 0

    @property
    def lease_span_count(self) -> int:
        """How many ``kv_lease`` spans were read."""
        return sum(1 for s in self.spans if s.name == sc.LEASE_SPAN_NAME)

    def describe(self) -> dict:
        """What was searched, for reports: run dir, span dirs, counts of files, spans, lease spans,
        bad lines and torn tails."""
        return {
            "run_dir": str(self.run_dir),
            "span_dirs": [str(d) for d in self.span_dirs],
            "files": len(self.files),
            "spans": len(self.spans),
            "lease_spans": self.lease_span_count,
            "bad_lines": self.bad_lines,
            "incomplete_tails": self.incomplete_tails,
        }


def search_spans(run_dir: str | os.PathLike[str]) -> SpanSearch:
    """Read every ``*.jsonl`` span file of every span dir below ``run_dir``; never raises for a bad
    or torn line (counted). A missing ``run_dir`` gives an empty search."""
    result = SpanSearch(Path(run_dir), find_span_dirs(run_dir))
    paths = sorted({str(p) for d in result.span_dirs for p in d.glob("*.jsonl")})
    read = read_span_files(paths)
    result.files, result.spans = read.files, read.spans
    result.bad_lines, result.incomplete_tails = read.bad_lines, read.incomplete_tails
    return result


def request_ids_of(span: SpanRecord) -> set[str]:
    """The request ids a span names: ``gen_ai.request.id`` and any other string attribute whose key
    ends in ``request.id`` or ``request_id`` (e.g. a D-side span naming P's request id)."""
    ids = set()
    for key, value in span.attributes.items():
        if isinstance(value, str) and value and (key == sc.REQUEST_ID or key.endswith(("request.id", "request_id"))):
            ids.add(value)
    return ids


@dataclass(frozen=True)
class RequestMatch:
    """How a query matched: ``request_id`` (None if no unique match), ``matched_by`` (``"exact"``,
    ``"prefix"`` or None) and ``candidates`` (every request id starting with the query when the
    prefix was ambiguous, sorted)."""

    request_id: str | None
    matched_by: str | None
    candidates: tuple[str, ...] = ()


def match_request(spans: list[SpanRecord], query: str) -> RequestMatch:
    """Resolve ``query`` to one request id: an exact match first, else a unique prefix of one, else,
    among the ids the prefix matches, the one lease key (``gen_ai.request.id``): leasekit's router
    sends P and D one ``X-Request-Id``, so P's request id and D's own (``cmpl-<X-Request-Id>-0-<8 hex>``
    each) share every prefix up to the random suffix, and the client-visible ``cmpl-<X-Request-Id>``
    names P's lease.

    Returns:
        A :class:`RequestMatch`; ``request_id`` is None when nothing matches or the prefix is
        ambiguous (then ``candidates`` lists the ids it matches).
    """
    known: set[str] = set()
    lease_keys: set[str] = set()
    for span in spans:
        known |= request_ids_of(span)
        if isinstance(key := span.attributes.get(sc.REQUEST_ID), str):
            lease_keys.add(key)
    if query in known:
        return RequestMatch(query, "exact")
    candidates = tuple(sorted(i for i in known if i.startswith(query))) if query else ()
    if len(candidates) == 1:
        return RequestMatch(candidates[0], "prefix")
    keyed = [i for i in candidates if i in lease_keys]
    if len(keyed) == 1:
        return RequestMatch(keyed[0], "prefix")
    return RequestMatch(None, None, candidates)


def spans_for(spans: list[SpanRecord], request_id: str) -> list[SpanRecord]:
    """The spans naming ``request_id`` (see :func:`request_ids_of`), by start time then source."""
    chosen = [s for s in spans if request_id in request_ids_of(s)]
    return sorted(chosen, key=lambda s: (s.start_unix_ns, s.source, s.span_id))
