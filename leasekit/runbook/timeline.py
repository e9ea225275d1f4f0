"""One request's lease story from its spans: the pure half of ``leasekit explain``.

Names of spans, events and attributes: :mod:`leasekit.telemetry.semconv` (docs/telemetry.md).
Times of a ``kv_lease`` span are shown relative to its grant on P's own monotonic clock
(``leasekit.*_monotonic_s``), the clock its deadlines live on; spans of other processes (D side)
can only be placed on the wall clock, relative to the earliest grant's wall time (docs/lease-model.md
invariant 4: no deadline of one process is compared with another's clock).
"""

from __future__ import annotations

from typing import Any

from leasekit.lease.bounds import RECLAIM_LAG_FLOOR_S, reclaim_deadline
from leasekit.lease.config import LeaseTiming
from leasekit.runbook.common import wall_time
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.spanfile import SpanRecord

EPSILON_S = 1e-6
"""Tolerance in seconds for comparing instants rebuilt from float attributes."""

WITHIN_BOUND, EXCEEDED, PREMATURE, NOT_APPLICABLE, UNKNOWN = (
    "WITHIN_BOUND", "EXCEEDED", "PREMATURE", "NOT_APPLICABLE", "UNKNOWN")

_EVENT_SHOWN = {sc.EV_MONOTONIC_S, sc.EV_DEADLINE_REMAINING_S}


def _rel(t: Any, origin: float) -> float | None:
    return None if t is None else float(t) - origin


def _who(span: SpanRecord, key: str) -> Any:
    """An identity attribute from the span, else from its resource."""
    return span.attributes.get(key, span.resource.get(key))


def _identity(span: SpanRecord) -> dict[str, Any]:
    return {"span": span.name, "source": span.source, "engine_id": _who(span, sc.ENGINE_ID),
            "tp_rank": _who(span, sc.TP_RANK), "kv_role": _who(span, sc.KV_ROLE),
            "pid": span.resource.get("process.pid")}


def bound_check(span: SpanRecord, tick_s: float | None = None) -> dict[str, Any]:
    """The reclaim-bound check of one ended ``kv_lease`` span; times in seconds after the grant.

    Rule (docs/lease-model.md "Bounds", :func:`leasekit.lease.bounds.reclaim_deadline`): an expired lease may
    be reclaimed from ``deadline = max(grant + L, last_extend + E)`` and must be by
    ``deadline + tick``. ``tick_s`` is P's step-period allowance; None uses the step gap the span
    recorded (``leasekit.step_gap_s``, the tick this reap waited on).

    Returns:
        ``{verdict, detail, tick_s, tick_source, grant_plus_L_s, last_extend_plus_E_s,
        reclaim_deadline_s, recorded_deadline_s, actual_end_s, lag_s, bound_s}``: verdict
        ``WITHIN_BOUND``, ``EXCEEDED`` (end > deadline + tick), ``PREMATURE`` (end < deadline:
        invariant 2), ``UNKNOWN`` (no tick known, attributes missing, or times that cannot be on one
        clock, e.g. a heartbeat before the grant) or ``NOT_APPLICABLE``
        (released/aborted/open lease: the bound is about expiries).
    """
    a = span.attributes
    out: dict[str, Any] = {k: None for k in ("tick_s", "tick_source", "grant_plus_L_s", "last_extend_plus_E_s",
                                             "reclaim_deadline_s", "recorded_deadline_s", "actual_end_s",
                                             "lag_s", "bound_s")}
    outcome = a.get(sc.OUTCOME)
    needed = (sc.GRANT_MONOTONIC_S, sc.LEASE_DURATION_S, sc.EXTENSION_S, sc.END_MONOTONIC_S)
    if outcome != sc.OUTCOME_EXPIRED:
        what = f"outcome {outcome}" if outcome else "no end recorded (lease still open or its process died)"
        return {"verdict": NOT_APPLICABLE, "detail": f"{what}: the reclaim bound applies to expired leases", **out}
    if any(k not in a for k in needed):
        missing = ", ".join(k for k in needed if k not in a)
        return {"verdict": UNKNOWN, "detail": f"span lacks {missing}", **out}
    grant, L, E = float(a[sc.GRANT_MONOTONIC_S]), float(a[sc.LEASE_DURATION_S]), float(a[sc.EXTENSION_S])
    last = a.get(sc.LAST_EXTEND_MONOTONIC_S)
    timing = LeaseTiming(lease_duration_s=L, heartbeat_interval_s=L // 6, extension_s=E)
    try:
        deadline = reclaim_deadline(timing, grant, None if last is None else float(last))
    except ValueError as exc:  # a heartbeat before the grant, or a non-finite time: not one clock
        return {"verdict": UNKNOWN, "detail": f"cannot compute the reclaim deadline: {exc}", **out}
    end = float(a[sc.END_MONOTONIC_S])
    if tick_s is None:
        # the allowance LeaseReclaimLagOverBound alerts on; the recorded step gap is shown, not used:
        # a stalled P has a long step gap, and judging it by its own stall would always pass
        tick_s = max(float(timing.heartbeat_interval_s), RECLAIM_LAG_FLOOR_S)
        out["tick_source"] = f"default max(H, {RECLAIM_LAG_FLOOR_S:g} s), as LeaseReclaimLagOverBound"
        if a.get(sc.STEP_GAP_S) is not None:
            out["tick_source"] += f"; P's step gap before this reap was {float(a[sc.STEP_GAP_S]):.3f} s"
    else:
        out["tick_source"] = "--tick"
    out.update(tick_s=tick_s, grant_plus_L_s=L, last_extend_plus_E_s=None if last is None else float(last) - grant + E,
               reclaim_deadline_s=deadline - grant, actual_end_s=end - grant, lag_s=end - deadline,
               recorded_deadline_s=_rel(a.get(sc.DEADLINE_MONOTONIC_S), grant))
    formula = (f"max(grant + L = {L:.3f}, last_extend + E = "
               + ("none" if last is None else f"{float(last) - grant + E:.3f}") + f") = {deadline - grant:.3f} s")
    if end < deadline - EPSILON_S:
        return {"verdict": PREMATURE, "detail": f"reclaimed {deadline - end:.3f} s BEFORE its deadline {formula}: "
                "a premature reclaim (docs/lease-model.md invariant 2)", **out}
    if tick_s is None:
        return {"verdict": UNKNOWN, "detail": f"deadline {formula}, reclaimed {end - deadline:.3f} s after it; "
                "no step gap recorded: pass --tick to check the bound", **out}
    out["bound_s"] = deadline + tick_s - grant
    if end > deadline + tick_s + EPSILON_S:
        return {"verdict": EXCEEDED, "detail": f"reclaimed {end - deadline:.3f} s after its deadline {formula}, "
                f"more than the tick {tick_s:.3f} s: the bound is exceeded by {end - deadline - tick_s:.3f} s", **out}
    return {"verdict": WITHIN_BOUND, "detail": f"reclaimed {end - deadline:.3f} s after its deadline {formula}, "
            f"within the tick {tick_s:.3f} s ({out['tick_source']})", **out}


def lease_view(span: SpanRecord, tick_s: float | None = None) -> dict[str, Any]:
    """A ``kv_lease`` span as a timeline; times in seconds after its grant on P's monotonic clock.

    Returns:
        Identity (``span, source, engine_id, tp_rank, kv_role, pid``), the lease's attributes
        (``remote_agent``: the D worker's peer reference ``peer-<12 hex>``, never its agent name;
        ``kv_blocks, lease_duration_s, extension_s, outcome, abort_reason``, ``expiry_peer_state``), wall
        times (``grant_wall``, ``end_wall``), instants after the grant (``initial_deadline_s``,
        ``deadline_s``, ``last_extend_s``, ``end_s``), ``extend_count`` vs ``extend_events_kept``
        and ``extend_events_dropped``, ``retrievals``, ``reclaim_lag_s``, ``step_gap_s``, ``events``
        (``[{event, t_after_grant_s, wall_time, deadline_remaining_s, attributes}]``) and ``bound``
        (:func:`bound_check`).
    """
    a = span.attributes
    grant = float(a.get(sc.GRANT_MONOTONIC_S, 0.0))
    events = []
    for ev in span.events:
        t = ev.attributes.get(sc.EV_MONOTONIC_S)
        events.append({"event": ev.name, "t_after_grant_s": _rel(t, grant), "wall_time": wall_time(ev.time_unix_ns),
                       "deadline_remaining_s": ev.attributes.get(sc.EV_DEADLINE_REMAINING_S),
                       "attributes": {k: v for k, v in ev.attributes.items() if k not in _EVENT_SHOWN}})
    grant_ev = next((ev for ev in span.events if ev.name == sc.EVENT_GRANT), None)
    return {
        **_identity(span),
        "remote_agent": a.get(sc.REMOTE_AGENT), "kv_blocks": a.get(sc.KV_BLOCKS),
        "lease_duration_s": a.get(sc.LEASE_DURATION_S), "extension_s": a.get(sc.EXTENSION_S),
        "outcome": a.get(sc.OUTCOME), "abort_reason": a.get(sc.ABORT_REASON),
        "expiry_peer_state": a.get(sc.EXPIRY_PEER_STATE),
        "grant_monotonic_s": a.get(sc.GRANT_MONOTONIC_S),
        "grant_wall": wall_time(grant_ev.time_unix_ns if grant_ev else span.start_unix_ns),
        "end_wall": wall_time(span.end_unix_ns),
        "initial_deadline_s": _rel(a.get(sc.INITIAL_DEADLINE_MONOTONIC_S), grant),
        "deadline_s": _rel(a.get(sc.DEADLINE_MONOTONIC_S), grant),
        "last_extend_s": _rel(a.get(sc.LAST_EXTEND_MONOTONIC_S), grant),
        "end_s": _rel(a.get(sc.END_MONOTONIC_S), grant),
        "extend_count": a.get(sc.EXTEND_COUNT),
        "extend_events_kept": sum(1 for ev in span.events if ev.name == sc.EVENT_EXTEND),
        "extend_events_dropped": a.get(sc.EXTEND_EVENTS_DROPPED),
        "retrievals": a.get(sc.RETRIEVALS),
        "reclaim_lag_s": a.get(sc.RECLAIM_LAG_S), "step_gap_s": a.get(sc.STEP_GAP_S),
        "events": events,
        "bound": bound_check(span, tick_s),
    }


def _same_process(a: SpanRecord, b: SpanRecord) -> bool:
    if a.source and a.source == b.source:
        return True
    keys = (sc.ENGINE_ID, sc.TP_RANK)
    pid = a.resource.get("process.pid")
    return pid is not None and pid == b.resource.get("process.pid") and all(_who(a, k) == _who(b, k) for k in keys)


def late_read_view(span: SpanRecord, leases: list[SpanRecord]) -> dict[str, Any]:
    """A ``kv_lease_late_read`` span; ``t_after_grant_s`` and ``end_after_grant_s`` are set only when
    a lease span of the same process (same span file, or engine, rank and pid) gives the grant on
    the same monotonic clock, else None."""
    a = span.attributes
    lease = next((s for s in leases if _same_process(s, span) and sc.GRANT_MONOTONIC_S in s.attributes), None)
    grant = None if lease is None else float(lease.attributes[sc.GRANT_MONOTONIC_S])
    return {
        **_identity(span),
        "wall_time": wall_time(span.start_unix_ns), "ended_outcome": a.get(sc.ENDED_OUTCOME),
        "late_by_s": a.get(sc.LATE_BY_S), "remote_agent": a.get(sc.REMOTE_AGENT),
        "t_after_grant_s": None if grant is None else _rel(a.get(sc.EV_MONOTONIC_S), grant),
        "end_after_grant_s": None if grant is None else _rel(a.get(sc.END_MONOTONIC_S), grant),
    }


def other_span_view(span: SpanRecord, origin_ns: int) -> dict[str, Any]:
    """Any other span naming the request (e.g. D's ``kv_lease_heartbeats``), shown generically.

    Its ``*_after_origin_wall_s`` times are wall-clock seconds after ``origin_ns`` (another
    process's clock: approximate). Each event's ``t_own_clock_s`` is its ``leasekit.monotonic_s``
    minus the span's first event's (exact, on the emitting process's clock), None without one.
    """
    first = next((ev.attributes[sc.EV_MONOTONIC_S] for ev in span.events if sc.EV_MONOTONIC_S in ev.attributes), None)
    return {
        **_identity(span),
        "start_wall": wall_time(span.start_unix_ns), "end_wall": wall_time(span.end_unix_ns),
        "start_after_origin_wall_s": (span.start_unix_ns - origin_ns) / 1e9,
        "end_after_origin_wall_s": (span.end_unix_ns - origin_ns) / 1e9,
        "duration_s": (span.end_unix_ns - span.start_unix_ns) / 1e9,
        "attributes": dict(span.attributes),
        "events": [{"event": ev.name, "t_after_origin_wall_s": (ev.time_unix_ns - origin_ns) / 1e9,
                    "t_own_clock_s": None if first is None else _rel(ev.attributes.get(sc.EV_MONOTONIC_S), first),
                    "wall_time": wall_time(ev.time_unix_ns), "attributes": dict(ev.attributes)} for ev in span.events],
    }


def explain_spans(spans: list[SpanRecord], tick_s: float | None = None) -> dict[str, Any]:
    """The story of one request from the spans naming it.

    Returns:
        ``{"origin": {wall_time, what}, "leases": [lease_view], "late_reads": [late_read_view],
        "other_spans": [other_span_view]}``; the origin is the earliest lease's grant (wall clock),
        else the earliest span start.
    """
    leases = [s for s in spans if s.name == sc.LEASE_SPAN_NAME]
    late = [s for s in spans if s.name == sc.LATE_READ_SPAN_NAME]
    others = [s for s in spans if s.name not in (sc.LEASE_SPAN_NAME, sc.LATE_READ_SPAN_NAME)]
    grants = [ev.time_unix_ns for s in leases for ev in s.events if ev.name == sc.EVENT_GRANT]
    if grants:
        origin, what = min(grants), "grant of the earliest lease span"
    else:
        origin, what = min((s.start_unix_ns for s in spans), default=0), "start of the earliest span"
    return {
        "origin": {"wall_time": wall_time(origin), "what": what},
        "leases": [lease_view(s, tick_s) for s in leases],
        "late_reads": [late_read_view(s, leases) for s in late],
        "other_spans": [other_span_view(s, origin) for s in others],
    }
