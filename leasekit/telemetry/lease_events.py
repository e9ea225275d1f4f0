"""The lease event: one record per lease transition, handed to every observer (metrics, logs).

:class:`leasekit.telemetry.lease_spans.LeaseSpanRecorder` is the one place that turns vLLM's hooks
into transitions; it records each on the lease span and then passes a :class:`LeaseEvent` to its
observers, so spans, Prometheus metrics and log records always describe the same transitions
(data flows one way: vLLM -> recorder -> spans / metrics / logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GRANT = "grant"
EXTEND = "extend"
RELEASE = "release"
EXPIRE = "expire"
ABORT = "abort"
LATE_READ = "late_read"
KINDS = (GRANT, EXTEND, RELEASE, EXPIRE, ABORT, LATE_READ)

CAUSE_NO_HEARTBEAT = "no_heartbeat"
CAUSE_HEARTBEAT_LAPSED = "heartbeat_lapsed"
CAUSE_MAX_HOLD = "max_hold"


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """One lease transition on one P worker. Times are seconds; ``*_s`` instants are on the
    worker's ``time.perf_counter`` (where vLLM keeps lease deadlines).

    Attributes:
        kind: one of :data:`KINDS`.
        req_id: P's request id (the lease key; never a metric label).
        engine_id, tp_rank, kv_role: the P engine and worker.
        now_s: when the transition was recorded.
        kv_blocks: KV blocks the lease pins (grant and end events; None if unknown).
        remote_agent: NIXL agent name of the D worker, if P has heard from it.
        deadline_remaining_s: deadline - now after the transition (negative: past the deadline).
        hold_s: grant to end (end events).
        gap_s: extend: time since the previous delivered heartbeat, or since the grant.
        outcome: end events: ``released``, ``expired`` or ``aborted``; late_read: the ended outcome.
        cause: expire: ``no_heartbeat`` (none delivered) or ``heartbeat_lapsed``.
        reclaim_lag_s: expire: end - deadline (the reaper's delay).
        step_gap_s: expire: time since P's previous engine step.
        late_by_s: late_read: time since the lease ended.
        fail_closed: late_read: True when the reading D agent speaks the fail-closed protocol (P answered
            ``reaped``, so D discards the read: docs/fail-closed.md), False when it does not (the read may
            have become tokens), None when unknown.
        reason: abort: why.
    """

    kind: str
    req_id: str
    engine_id: str
    tp_rank: int
    kv_role: str
    now_s: float
    kv_blocks: int | None = None
    remote_agent: str | None = None
    deadline_remaining_s: float | None = None
    hold_s: float | None = None
    gap_s: float | None = None
    outcome: str | None = None
    cause: str | None = None
    reclaim_lag_s: float | None = None
    step_gap_s: float | None = None
    late_by_s: float | None = None
    fail_closed: bool | None = None
    reason: str | None = None


LeaseObserver = Callable[[LeaseEvent], None]
"""Anything called with each :class:`LeaseEvent`; it may raise (the connector logs and goes on).

Two optional methods keep the per-heartbeat path cheap (one extension per lease per heartbeat):
``on_extend(remote_agent, gap_s)``, if present, is called for every extension instead of building an
EXTEND event for that observer; ``wants(kind) -> bool``, if present, is asked before an event of
``kind`` is built for it (e.g. a log observer whose level is off)."""
