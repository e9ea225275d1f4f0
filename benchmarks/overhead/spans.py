"""Span volume of the telemetry-overhead benchmark: what a pair's span files hold (:class:`SpanCounter`),
the spans one phase added (:class:`SpanPhase`) and whether span volume is O(requests), not
O(requests x heartbeats) (:func:`span_volume_verdict`). Only :meth:`SpanCounter.snapshot` reads
files; the rest is pure."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple


@dataclass
class SpanPhase:
    """Spans the leasekit pair wrote during one phase.

    Attributes:
        name: e.g. ``round 3``, ``rounds`` (all rounds together) or ``queued 6H``.
        requests: P->D requests routed in the phase.
        spans: spans written (all span names; the difference of the span-file totals).
        extensions: one entry per lease of the phase seen in the span files: its extension count
            (``leasekit.extend_count``: heartbeats P handled).
        by_name: spans per span name.
        outcomes: leases per lease outcome (``released``, ...).
        hold_s: how long the phase's requests waited in D's queue (seconds; 0 for the rounds).
    """

    name: str
    requests: int
    spans: int
    extensions: list[int] = field(default_factory=list)
    by_name: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    hold_s: float = 0.0

    @property
    def spans_per_request(self) -> float:
        """Spans written per request routed; NaN for a phase without requests."""
        return self.spans / self.requests if self.requests else math.nan

    @property
    def mean_extensions(self) -> float:
        """Mean extensions per lease seen; NaN when no lease was seen."""
        return statistics.fmean(self.extensions) if self.extensions else math.nan

    def to_json(self) -> dict[str, Any]:
        """This phase as the result file stores it (``extensions`` summarized as mean, max and
        ``leases_seen``; ``hold_s`` in seconds). Never raises."""
        return {
            "name": self.name, "requests": self.requests, "spans": self.spans, "hold_s": self.hold_s,
            "spans_per_request": self.spans_per_request, "mean_extensions_per_lease": self.mean_extensions,
            "max_extensions_per_lease": max(self.extensions) if self.extensions else None,
            "leases_seen": len(self.extensions), "by_name": self.by_name, "outcomes": self.outcomes,
        }


def merge_phases(name: str, phases: Sequence[SpanPhase]) -> SpanPhase:
    """One phase called ``name`` holding all of ``phases``: requests, spans and per-name and
    per-outcome counts summed, extensions concatenated (``hold_s`` 0). Never raises."""
    return SpanPhase(name, sum(p.requests for p in phases), sum(p.spans for p in phases),
                     [x for p in phases for x in p.extensions],
                     dict(sum((Counter(p.by_name) for p in phases), Counter())),
                     dict(sum((Counter(p.outcomes) for p in phases), Counter())))


def span_volume_verdict(phases: Sequence[SpanPhase], *, min_extension_growth: float = 2.0,
                        max_slope: float = 0.1) -> dict[str, Any]:
    """Whether span volume is O(requests): between the phase with the fewest and the one with the
    most mean extensions per lease, spans per request must not follow the extensions.

    slope = d(spans/request) / d(extensions/lease): a span per extension would make it >= 1; events
    on one span per lease make it 0. ``shown`` when extensions grew by at least
    ``min_extension_growth`` per lease and |slope| <= ``max_slope``; ``not shown`` when extensions
    did not grow enough to tell (with the reason); ``violated`` when spans grew with them.

    Returns:
        ``{"status": "shown" | "violated" | "not shown", "slope": float | None, "reason": str}``.
        Phases without requests or without leases are ignored. Never raises.
    """
    usable = [p for p in phases if p.requests and p.extensions]
    if len(usable) < 2:
        return {"status": "not shown", "slope": None, "reason": "fewer than two phases with leases"}
    lo = min(usable, key=lambda p: p.mean_extensions)
    hi = max(usable, key=lambda p: p.mean_extensions)
    growth = hi.mean_extensions - lo.mean_extensions
    if growth < min_extension_growth:
        return {"status": "not shown", "slope": None,
                "reason": f"extensions per lease grew only {growth:.1f} ({lo.name} -> {hi.name}); "
                          f"hold requests in D's queue longer"}
    slope = (hi.spans_per_request - lo.spans_per_request) / growth
    status = "shown" if abs(slope) <= max_slope else "violated"
    return {"status": status, "slope": slope,
            "reason": f"{lo.name}: {lo.spans_per_request:.2f} spans/request at {lo.mean_extensions:.1f} "
                      f"extensions/lease; {hi.name}: {hi.spans_per_request:.2f} at {hi.mean_extensions:.1f} "
                      f"(slope {slope:+.3f} spans per extension; limit {max_slope})"}


class SpanSnapshot(NamedTuple):
    """What a pair's span files hold at one moment.

    Attributes:
        spans: spans in all files.
        by_name: spans per span name.
        leases: ``{P request id: (extensions, outcome)}`` from every lease span.
        bad_lines: lines that did not parse as a span.
    """

    spans: int
    by_name: Counter
    leases: dict[str, tuple[int, str]]
    bad_lines: int

    def phase_since(self, before: SpanSnapshot, name: str, requests: int, request_ids: Iterable[str],
                    hold_s: float = 0.0) -> SpanPhase:
        """The :class:`SpanPhase` ``name`` between ``before`` and this snapshot: the spans added, and
        the extensions and outcomes of the leases of ``request_ids`` (P's ids; ids without a lease
        span are left out). ``requests`` is the phase's routed request count, ``hold_s`` its queue
        wait in seconds. Never raises."""
        seen = [i for i in request_ids if i in self.leases]
        return SpanPhase(name, requests, self.spans - before.spans, [self.leases[i][0] for i in seen],
                         dict(self.by_name - before.by_name), dict(Counter(self.leases[i][1] for i in seen)),
                         hold_s=hold_s)


class SpanCounter:
    """Reads a pair's span directory (``<pair run dir>/spans``): totals, totals per span name, lease
    extensions by request id."""

    def __init__(self, span_dir: Path):
        self.span_dir = span_dir

    def snapshot(self) -> SpanSnapshot:
        """The span files as they are now; all zero and empty while the directory does not exist.

        Raises:
            OSError: a span file exists but could not be read (one that vanished is skipped).
        """
        from leasekit.telemetry.lease_timeline import timeline_from_span
        from leasekit.telemetry.spanfile import read_span_dir

        if not self.span_dir.is_dir():
            return SpanSnapshot(0, Counter(), {}, 0)
        result = read_span_dir(self.span_dir)
        leases = {}
        for span in result.spans:
            timeline = timeline_from_span(span)
            if timeline is not None:
                leases[timeline.request_id] = (timeline.heartbeat_count, timeline.outcome)
        return SpanSnapshot(len(result.spans), Counter(s.name for s in result.spans), leases, result.bad_lines)
