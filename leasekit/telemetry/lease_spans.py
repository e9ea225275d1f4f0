"""Lease spans: one OpenTelemetry span per lease per P worker (TP rank), from grant to its end.

Each transition is a *span event* on the lease span, not a child span (a child span per heartbeat would
make span volume grow with requests x heartbeats). Nothing of the span exists while the lease is open:
the recorder keeps a compact record (a few numbers, the kept events in a flat ``array``: a few hundred
bytes whatever the heartbeat count); when the lease ends the span is built, with its start time and
event timestamps set back to each transition, by a :class:`~leasekit.telemetry.span_builder.SpanBuilder`
(in production on its own thread, so P's engine step pays a few field writes per transition, and the
span processors encode and write off that thread too). Extension events are bounded
(``max_extend_events``: the first extension and the latest ones are kept; the others are counted in
``leasekit.extend_events_dropped``), while ``leasekit.extend_count`` and
``leasekit.last_extend_monotonic_s`` always carry the full count and the last delivered heartbeat; every
heartbeat also reaches the metrics (``leasekit_kv_lease_extensions_total``, the heartbeat-gap histogram)
through the observers.

Times passed in are seconds on the worker's ``time.perf_counter`` (where vLLM keeps lease deadlines,
vllm 0.32.0 ``base_worker.py: _reqs_to_send``), recorded as ``leasekit.monotonic_s``. A process killed
while a lease is open writes no span for it (a span is exported when it ends).

Callers pass a D worker's NIXL agent name (``remote_agent=``); spans and events carry its
:func:`~leasekit.lease.peerref.peer_ref`, never the name (:class:`~leasekit.telemetry.peers.Peer`, looked up
once per lease, also decides an expiry's ``peer_state``).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Sequence

from opentelemetry import trace

from leasekit.lease.config import LeaseTiming
from leasekit.lease.peerref import peer_ref
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_events import LeaseEvent, LeaseObserver
from leasekit.telemetry.peers import Peer, PeerTable
from leasekit.telemetry.span_builder import SpanBuilder
from leasekit.telemetry.late_spans import LateSpans
from leasekit.telemetry.tracecontext import parent_context

MAX_RETRIEVAL_EVENTS = 8
"""Read-completion events kept per lease span (one per consumer rank; later ones are counted only)."""


@dataclass(slots=True)
class _OpenLease:
    """What the recorder keeps of one open lease (the span is built from it when the lease ends)."""

    deadline_s: float
    grant_s: float
    granted_now_s: float  # ``now`` at the grant call: the grant event's instant
    parent: Any = None  # the request's W3C trace context, if it carried one
    kv_blocks: int | None = None
    extend_count: int = 0
    retrievals: int = 0
    last_extend_s: float | None = None
    peer: Peer | None = None  # the D agent first heard from about this lease
    extends: Any = None  # array('f'), flat (now_s - grant_s, deadline_s - grant_s): the first, then the latest
    reads: tuple = ()  # kept retrieval events: ((now_s, peer_ref of the reading agent), ...)
    extra: tuple = ()  # annotate(): (key, value, key, value, ...)


class LeaseSpanRecorder(LateSpans):
    """Turns the lease transitions of one P worker into spans.

    Every method is O(1), never raises for an unknown request id (it returns False and records
    nothing), and takes an optional ``now`` (seconds, worker perf_counter) for tests.

    Args:
        tracer: the tracer to start spans on.
        engine_id: this P engine's id (vLLM ``kv_transfer_config.engine_id``).
        tp_rank: this worker's tensor-parallel rank.
        timing: the lease timing in force (recorded on every span).
        kv_role: vLLM ``kv_role`` of this engine (``kv_producer`` for P).
        clock: seconds clock used when ``now`` is not given; must be the clock deadlines use.
        max_extend_events: extension events kept per span (>= 0): the first and the latest
            ``max_extend_events - 1``; the others are counted in ``leasekit.extend_events_dropped``.
        observers: called with a :class:`LeaseEvent` after each transition is on the span
            (Prometheus stats, structured logs); an observer's exception propagates to the caller.
        spans: where ended leases' spans are built (:class:`leasekit.telemetry.span_builder.SpanBuilder`;
            default: inline, on the caller's thread; the connector passes a background one).

    Raises:
        ValueError: ``max_extend_events`` is negative.
    """

    def __init__(self, tracer: trace.Tracer, *, engine_id: str, tp_rank: int, timing: LeaseTiming,
                 kv_role: str = "kv_producer", clock: Callable[[], float] = time.perf_counter,
                 max_extend_events: int = 8, observers: Sequence[LeaseObserver] = (),
                 spans: SpanBuilder | None = None):
        if max_extend_events < 0:
            raise ValueError(f"max_extend_events must be >= 0, got {max_extend_events}")
        self._tracer = tracer
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._kv_role = kv_role
        self._timing = timing
        self._clock = clock
        self._max_extend_events = max_extend_events
        self._observers = tuple(observers)
        self._on_extend = tuple(o.on_extend for o in observers if hasattr(o, "on_extend"))
        self._extend_observers = tuple(o for o in observers if not hasattr(o, "on_extend"))
        self._wants = {ext: tuple((o, getattr(o, "wants", None)) for o in (self._extend_observers if ext else observers))
                       for ext in (True, False)}  # extension or not -> (observer, its filter or None)
        self._spans = spans if spans is not None else SpanBuilder(background=False)
        self._open: dict[str, _OpenLease] = {}
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()  # req_id -> (outcome, end s)
        self._ended_memory = 65536
        self._peers = PeerTable()
        self._known = self._peers.known  # agent name -> Peer: the per-lease lookup, without a call

    # -- queries ---------------------------------------------------------------------------
    def has(self, req_id: str) -> bool:
        """Whether a lease for ``req_id`` is open on this worker."""
        return req_id in self._open

    @property
    def timing(self) -> LeaseTiming:
        """The lease timing recorded on every span."""
        return self._timing

    @property
    def active(self) -> int:
        """Number of open leases on this worker."""
        return len(self._open)

    def open_ids(self) -> list[str]:
        """Request ids of the open leases (a copy)."""
        return list(self._open)

    def deadline(self, req_id: str) -> float | None:
        """The last deadline recorded for ``req_id`` (seconds, worker clock), or None."""
        lease = self._open.get(req_id)
        return None if lease is None else lease.deadline_s

    def grant_time(self, req_id: str) -> float | None:
        """When ``req_id``'s open lease was granted (deadline at grant minus ``L``; seconds, worker clock), or None."""
        lease = self._open.get(req_id)
        return None if lease is None else lease.grant_s

    def expiring_within(self, seconds: float, now: float | None = None) -> int:
        """How many open leases have a deadline less than ``seconds`` away (O(open leases); tests only)."""
        limit = (self._clock() if now is None else now) + seconds
        return sum(1 for lease in self._open.values() if lease.deadline_s < limit)

    def _peer(self, req_id: str, agent: str, now: float) -> Peer:
        """The :class:`Peer` of ``agent``, first heard from about ``req_id`` at ``now``; a PEER_RETURNED
        event if it comes back after leases of it expired while it was silent."""
        peer = self._peers.get(agent, now, (lease.peer for lease in self._open.values()))
        returned = peer.come_back(now)
        if returned:
            self._emit(ev.PEER_RETURNED, req_id, now, remote_agent=peer.ref, count=returned)
        return peer

    def _emit(self, kind: str, req_id: str, now: float, **fields) -> None:
        event = None  # built only if some observer wants this kind (most heartbeats: none does)
        for observer, wants in self._wants[kind == ev.EXTEND]:
            if wants is None or wants(kind):
                if event is None:
                    event = LeaseEvent(kind, req_id, self._engine_id, self._tp_rank, self._kv_role, now, **fields)
                observer(event)

    # -- transitions -----------------------------------------------------------------------
    def grant(
        self,
        req_id: str,
        deadline_s: float,
        *,
        kv_blocks: int | None = None,
        trace_headers: Mapping[str, str] | None = None,
        now: float | None = None,
    ) -> bool:
        """Open the lease span for ``req_id`` with its first deadline. False if already open.

        ``trace_headers``: the request's W3C trace headers; the span then joins that trace."""
        if req_id in self._open:
            return False
        now = self._clock() if now is None else now
        self._open[req_id] = _OpenLease(deadline_s, deadline_s - self._timing.lease_duration_s, now,
                                        parent=parent_context(trace_headers), kv_blocks=kv_blocks)
        self._emit(ev.GRANT, req_id, now, kv_blocks=kv_blocks, deadline_remaining_s=deadline_s - now)
        return True

    def annotate(self, req_id: str, attributes: Mapping[str, Any]) -> bool:
        """Set extra attributes on ``req_id``'s open span (e.g. chaos evidence). False if unknown."""
        lease = self._open.get(req_id)
        if lease is None:
            return False
        for item in attributes.items():
            lease.extra += item
        return True

    def extend(self, req_id: str, deadline_s: float, *, remote_agent: str | None = None, now: float | None = None) -> bool:
        """Record a delivered heartbeat naming ``req_id`` and the deadline it left (``remote_agent``: the
        sender's NIXL agent name, recorded as its :func:`~leasekit.lease.peerref.peer_ref`). False if unknown."""
        lease = self._open.get(req_id)
        if lease is None:
            return False
        now = self._clock() if now is None else now
        gap_s = now - (lease.grant_s if lease.last_extend_s is None else lease.last_extend_s)
        lease.extend_count += 1
        lease.deadline_s = deadline_s
        lease.last_extend_s = now
        peer = lease.peer
        if peer is not None:
            peer.last_s = now
        elif remote_agent:
            peer = self._known.get(remote_agent)
            if peer is None or peer.lapsed:
                peer = self._peer(req_id, remote_agent, now)
            lease.peer = peer
            peer.last_s = now
        keep = self._max_extend_events
        if keep:
            kept = lease.extends
            if kept is None:
                kept = lease.extends = array("f")
            if len(kept) < 2 * keep:
                kept.extend((now - lease.grant_s, deadline_s - lease.grant_s))
            elif keep > 1:  # full: drop the oldest after the first, keep the latest
                del kept[2:4]
                kept.extend((now - lease.grant_s, deadline_s - lease.grant_s))
        for on_extend in self._on_extend:  # the per-heartbeat fast path (no event object)
            on_extend(gap_s)
        for _observer, wants in self._wants[True]:
            if wants is None or wants(ev.EXTEND):  # someone logs extensions: build the event once
                self._emit(ev.EXTEND, req_id, now, remote_agent=peer and peer.ref, gap_s=gap_s,
                           deadline_remaining_s=deadline_s - now)
                break
        return True

    def retrieval(self, req_id: str, *, remote_agent: str | None = None, now: float | None = None) -> bool:
        """Record one read-completion notification of ``remote_agent`` (one consumer rank done). False if unknown."""
        lease = self._open.get(req_id)
        if lease is None:
            return False
        now = self._clock() if now is None else now
        lease.retrievals += 1
        if remote_agent and lease.peer is None:
            lease.peer = self._peer(req_id, remote_agent, now)
        if len(lease.reads) < MAX_RETRIEVAL_EVENTS:
            lease.reads += ((now, peer_ref(remote_agent) if remote_agent else None),)
        return True

    def release(self, req_id: str, *, now: float | None = None) -> bool:
        """End the lease with outcome ``released`` (all consumers read it). False if unknown."""
        return self._end(req_id, sc.OUTCOME_RELEASED, sc.EVENT_RELEASE, now)

    def expire(self, req_id: str, *, step_gap_s: float | None = None, now: float | None = None,
               cause: str | None = None) -> bool:
        """End the lease with outcome ``expired`` (reaped at or after its deadline). False if unknown.

        ``step_gap_s``: seconds since P's previous engine step (the tick this reap waited on).
        ``cause``: overrides the derived cause (``no_heartbeat``/``heartbeat_lapsed``), e.g. ``max_hold``.
        """
        return self._end(req_id, sc.OUTCOME_EXPIRED, sc.EVENT_EXPIRE, now, step_gap_s=step_gap_s, cause=cause)

    def abort(self, req_id: str, reason: str, *, now: float | None = None) -> bool:
        """End the lease with outcome ``aborted`` (freed neither by release nor expiry). False if unknown."""
        return self._end(req_id, sc.OUTCOME_ABORTED, sc.EVENT_ABORT, now, reason=reason)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every ended lease's span has been built and ended (handed to the span processors);
        False if ``timeout_s`` seconds passed first."""
        return self._spans.flush(timeout_s)

    def abort_all(self, reason: str) -> int:
        """Abort every open lease (worker shutdown); returns how many were open."""
        ids = list(self._open)
        for req_id in ids:
            self.abort(req_id, reason)
        return len(ids)

    def _end(self, req_id: str, outcome: str, event: str, now: float | None, *, step_gap_s: float | None = None,
             reason: str | None = None, cause: str | None = None) -> bool:
        lease = self._open.pop(req_id, None)
        if lease is None:
            return False
        now = self._clock() if now is None else now
        end_ns = time.time_ns()
        expired, peer, peer_state = outcome == sc.OUTCOME_EXPIRED, lease.peer, None
        if not expired:
            cause = None
        else:
            if cause is None:
                cause = ev.CAUSE_NO_HEARTBEAT if lease.extend_count == 0 else ev.CAUSE_HEARTBEAT_LAPSED
            peer_state = ev.PEER_UNKNOWN if peer is None else peer.state(now, self._timing.heartbeat_interval_s)
            if peer_state == ev.PEER_SILENT:
                peer.lapse(now)  # type: ignore[union-attr]  # reported if this agent is heard from again
        self._spans.submit(partial(self._build, req_id, lease, outcome, event, now, end_ns, step_gap_s, reason, cause,
                                   peer_state))
        self._ended[req_id] = (outcome, now)
        while len(self._ended) > self._ended_memory:
            self._ended.popitem(last=False)
        self._emit(event, req_id, now, kv_blocks=lease.kv_blocks, remote_agent=peer and peer.ref,
                   deadline_remaining_s=lease.deadline_s - now, hold_s=now - lease.grant_s, outcome=outcome,
                   cause=cause, reclaim_lag_s=now - lease.deadline_s if expired else None, step_gap_s=step_gap_s,
                   reason=reason, peer_state=peer_state)
        return True

    def _build(self, req_id: str, lease: _OpenLease, outcome: str, event: str, now: float, end_ns: int,
               step_gap_s: float | None, reason: str | None, cause: str | None, peer_state: str | None) -> None:
        """Build and end the SDK span of an ended lease (on the span builder's thread in production):
        start time and event timestamps set back to each transition (``end_ns`` is wall-clock ns at ``now``)."""

        def at_ns(t: float) -> int:  # an instant on the worker clock, as wall-clock ns (span timestamps)
            return end_ns - int((now - t) * 1e9)

        expired = outcome == sc.OUTCOME_EXPIRED
        kept = [lease.grant_s + x for x in lease.extends] if lease.extends is not None else ()
        attributes = {
            sc.REQUEST_ID: req_id,
            sc.ENGINE_ID: self._engine_id,
            sc.KV_ROLE: self._kv_role,
            sc.TP_RANK: self._tp_rank,
            sc.LEASE_DURATION_S: float(self._timing.lease_duration_s),
            sc.EXTENSION_S: float(self._timing.extension_s),
            sc.GRANT_MONOTONIC_S: lease.grant_s,
            sc.INITIAL_DEADLINE_MONOTONIC_S: lease.grant_s + self._timing.lease_duration_s,
            sc.OUTCOME: outcome,
            sc.END_MONOTONIC_S: now,
            sc.DEADLINE_MONOTONIC_S: lease.deadline_s,
            sc.EXTEND_COUNT: lease.extend_count,
            sc.EXTEND_EVENTS_DROPPED: lease.extend_count - len(kept) // 2,
            sc.RETRIEVALS: lease.retrievals,
        }
        if lease.kv_blocks is not None:
            attributes[sc.KV_BLOCKS] = int(lease.kv_blocks)
        if lease.peer is not None:
            attributes[sc.REMOTE_AGENT] = lease.peer.ref
        if lease.last_extend_s is not None:
            attributes[sc.LAST_EXTEND_MONOTONIC_S] = lease.last_extend_s
        if expired:
            attributes[sc.RECLAIM_LAG_S] = now - lease.deadline_s
            attributes[sc.EXPIRY_CAUSE] = cause
            attributes[sc.EXPIRY_PEER_STATE] = peer_state
        if step_gap_s is not None:
            attributes[sc.STEP_GAP_S] = step_gap_s
        if reason:
            attributes[sc.ABORT_REASON] = reason
        attributes.update(zip(lease.extra[::2], lease.extra[1::2]))
        span = self._tracer.start_span(sc.LEASE_SPAN_NAME, context=lease.parent, kind=trace.SpanKind.INTERNAL,
                                       attributes=attributes, start_time=at_ns(lease.granted_now_s))
        t0 = lease.granted_now_s
        span.add_event(sc.EVENT_GRANT, {sc.EV_MONOTONIC_S: t0,
                                        sc.EV_DEADLINE_REMAINING_S: lease.grant_s + self._timing.lease_duration_s - t0},
                       timestamp=at_ns(t0))
        n_kept = len(kept) // 2  # the first extension, then the latest n_kept - 1 (consecutive)
        marks = [(kept[2 * j], 0, j) for j in range(n_kept)] + [(t, 1, i) for i, (t, _) in enumerate(lease.reads)]
        for t, kind, i in sorted(marks):  # extensions and retrievals in time order
            if kind == 0:
                count = 1 if i == 0 else lease.extend_count - (n_kept - 1 - i)
                span.add_event(sc.EVENT_EXTEND, {sc.EV_MONOTONIC_S: t, sc.EV_DEADLINE_REMAINING_S: kept[2 * i + 1] - t,
                                                 sc.EV_EXTEND_COUNT: count}, timestamp=at_ns(t))
            else:
                agent = lease.reads[i][1]
                read = {sc.EV_MONOTONIC_S: t, sc.EV_RETRIEVALS: i + 1}
                if agent:
                    read[sc.EV_REMOTE_AGENT] = agent
                span.add_event(sc.EVENT_RETRIEVAL, read, timestamp=at_ns(t))
        event_attributes = {
            sc.EV_MONOTONIC_S: now,
            sc.EV_DEADLINE_REMAINING_S: lease.deadline_s - now,
            sc.EV_RETRIEVALS: lease.retrievals,
        }
        if reason:
            event_attributes[sc.ABORT_REASON] = reason
        span.add_event(event, event_attributes, timestamp=end_ns)
        span.end(end_time=end_ns)
