"""Lease timelines: one ended lease on one P worker, rebuilt from P's lease spans (here) or from stock
vLLM's log lines (:mod:`leasekit.telemetry.vllm_log`). The chaos checks, reports and plots read these,
nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from leasekit.telemetry import semconv as sc
from leasekit.telemetry.spanfile import SpanRecord, read_span_dir


@dataclass(frozen=True)
class LeaseTimeline:
    """One ended lease on one P worker. Times are seconds on that worker's monotonic clock.

    ``grant_s`` is the instant P stamped the lease (initial deadline - L); ``heartbeats_s`` are the
    instants P handled heartbeats naming it (capped list; ``heartbeat_count`` is the full count).
    ``remote_agent`` is the span's ``leasekit.remote_agent``: the D worker's
    :func:`~leasekit.lease.peerref.peer_ref` (``peer-<12 hex>``), not its agent name; None if P never heard
    from one.
    """

    request_id: str
    engine_id: str
    tp_rank: int
    kv_blocks: int | None
    lease_duration_s: float
    extension_s: float
    grant_s: float
    initial_deadline_s: float
    heartbeats_s: tuple[float, ...]
    heartbeat_count: int
    last_heartbeat_s: float | None
    deadline_s: float
    end_s: float
    outcome: str
    retrievals: int
    step_gap_s: float | None
    remote_agent: str | None
    events: tuple[tuple[str, float], ...] = field(default=())
    stamp_latency_s: float = 0.0
    """How much later than the real instant a recorded heartbeat may be stamped (seconds): 0 for
    spans (LeaseKitConnector reads the clock before vLLM does); for log evidence, the log line is
    stamped after vLLM's own clock read (:data:`leasekit.telemetry.vllm_log.LOG_STAMP_LATENCY_S`)."""

    def relative(self, t: float | None) -> float | None:
        """``t`` in seconds after the grant (None stays None)."""
        return None if t is None else t - self.grant_s

    def to_json(self) -> dict:
        """A JSON-ready dict with times relative to the grant (seconds)."""
        return {
            "request_id": self.request_id,
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "kv_blocks": self.kv_blocks,
            "outcome": self.outcome,
            "heartbeats": self.heartbeat_count,
            "retrievals": self.retrievals,
            "remote_agent": self.remote_agent,
            "grant_monotonic_s": self.grant_s,
            "last_heartbeat_after_grant_s": self.relative(self.last_heartbeat_s),
            "deadline_after_grant_s": self.relative(self.deadline_s),
            "end_after_grant_s": self.relative(self.end_s),
            "step_gap_s": self.step_gap_s,
            "timeline": [{"event": name, "t_after_grant_s": t - self.grant_s} for name, t in self.events],
        }


def timeline_from_span(span: SpanRecord) -> LeaseTimeline | None:
    """Build a timeline from one ``kv_lease`` span; None for other spans or incomplete ones."""
    a = span.attributes
    if span.name != sc.LEASE_SPAN_NAME or sc.OUTCOME not in a:
        return None
    events = tuple(
        (ev.name, float(ev.attributes[sc.EV_MONOTONIC_S]))
        for ev in span.events
        if sc.EV_MONOTONIC_S in ev.attributes
    )
    return LeaseTimeline(
        request_id=str(a.get(sc.REQUEST_ID, "")),
        engine_id=str(a.get(sc.ENGINE_ID, "")),
        tp_rank=int(a.get(sc.TP_RANK, 0)),
        kv_blocks=a.get(sc.KV_BLOCKS),
        lease_duration_s=float(a.get(sc.LEASE_DURATION_S, 0.0)),
        extension_s=float(a.get(sc.EXTENSION_S, 0.0)),
        grant_s=float(a[sc.GRANT_MONOTONIC_S]),
        initial_deadline_s=float(a[sc.INITIAL_DEADLINE_MONOTONIC_S]),
        heartbeats_s=tuple(t for name, t in events if name == sc.EVENT_EXTEND),
        heartbeat_count=int(a.get(sc.EXTEND_COUNT, 0)),
        last_heartbeat_s=a.get(sc.LAST_EXTEND_MONOTONIC_S),
        deadline_s=float(a.get(sc.DEADLINE_MONOTONIC_S, a[sc.INITIAL_DEADLINE_MONOTONIC_S])),
        end_s=float(a[sc.END_MONOTONIC_S]),
        outcome=str(a[sc.OUTCOME]),
        retrievals=int(a.get(sc.RETRIEVALS, 0)),
        step_gap_s=a.get(sc.STEP_GAP_S),
        remote_agent=a.get(sc.REMOTE_AGENT),
        events=events,
    )


def lease_timelines(spans: Iterable[SpanRecord]) -> list[LeaseTimeline]:
    """Every ended lease among ``spans``."""
    return [t for t in (timeline_from_span(s) for s in spans) if t is not None]


def read_leases(span_dir: str | Path) -> tuple[list[LeaseTimeline], int]:
    """All ended leases in a span directory, and the number of unparsable span lines."""
    result = read_span_dir(span_dir)
    return lease_timelines(result.spans), result.bad_lines
