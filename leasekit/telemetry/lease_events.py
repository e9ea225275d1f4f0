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
PEER_RETURNED = "peer_returned"
KINDS = (GRANT, EXTEND, RELEASE, EXPIRE, ABORT, LATE_READ, PEER_RETURNED)

CAUSE_NO_HEARTBEAT = "no_heartbeat"
CAUSE_HEARTBEAT_LAPSED = "heartbeat_lapsed"
CAUSE_MAX_HOLD = "max_hold"

PEER_HEARTBEATING = "heartbeating"
PEER_SILENT = "silent"
PEER_UNKNOWN = "unknown"
PEER_STATES = (PEER_HEARTBEATING, PEER_SILENT, PEER_UNKNOWN)
"""What P knew of an expiring lease's D agent at the reap (rules: :mod:`leasekit.telemetry.peers`)."""


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
        remote_agent: the D worker P heard from about this lease, as
            :func:`leasekit.lease.peerref.peer_ref` of its NIXL agent name (``peer-<12 hex>``; never the
            name itself), or None if P has not heard from one.
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
        peer_state: expire: one of :data:`PEER_STATES`.
        count: peer_returned: how many leases of the agent ``remote_agent`` names expired while it was
            silent before P heard from it again (``req_id``: the lease it was heard about).
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
    peer_state: str | None = None
    count: int | None = None


LeaseObserver = Callable[[LeaseEvent], None]
"""Anything called with each :class:`LeaseEvent`; it may raise (the connector logs and goes on).

Two optional methods keep the per-heartbeat path cheap (one extension per lease per heartbeat):
``on_extend(gap_s)``, if present, is called for every extension (``gap_s``: seconds since the lease's
previous heartbeat or its grant) instead of building an EXTEND event for that observer; ``wants(kind) ->
bool``, if present, is asked before an event of ``kind`` is built for it (e.g. a log observer whose level is
off)."""
