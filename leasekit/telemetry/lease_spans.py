"""Lease spans: one OpenTelemetry span per lease per P worker (TP rank), from grant to its end.

Each transition is a *span event* on the lease span, not a child span: a lease sees one heartbeat
per interval ``H`` for as long as D keeps it waiting, and a child span per extension would make span
volume grow with requests x heartbeats. Events keep one span per lease; extension events are capped
(``max_extend_events``, oldest kept) while ``leasekit.extend_count`` and
``leasekit.last_extend_monotonic_s`` always carry the full count and the last delivered heartbeat.

Times passed in are seconds on the worker's ``time.perf_counter`` (where vLLM keeps lease deadlines,
vllm 0.32.0 ``base_worker.py: _reqs_to_send``); every event records it as ``leasekit.monotonic_s``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from leasekit.lease.config import LeaseTiming
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_events import LeaseEvent, LeaseObserver

_PROPAGATOR = TraceContextTextMapPropagator()


def parent_context(trace_headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The W3C trace context (``traceparent``/``tracestate``) of an incoming request, or None.

    vLLM keeps a request's trace headers on ``Request.trace_headers`` (vllm 0.32.0
    ``vllm/v1/request.py``, filled from the HTTP headers by ``serving.py: _get_trace_headers``);
    a lease span started in this context joins the request's trace (W3C Trace Context spec)."""
    if not trace_headers:
        return None
    ctx = _PROPAGATOR.extract(carrier=dict(trace_headers))
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


@dataclass(slots=True)
class _OpenLease:
    span: trace.Span
    deadline_s: float
    grant_s: float = 0.0
    kv_blocks: int | None = None
    extend_count: int = 0
    extend_events_dropped: int = 0
    retrievals: int = 0
    last_extend_s: float | None = None
    remote_agent: str | None = None


class LeaseSpanRecorder:
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
        max_extend_events: extension events kept per span (>= 0); later ones are counted only.
        observers: called with a :class:`LeaseEvent` after each transition is on the span
            (Prometheus stats, structured logs); an observer's exception propagates to the caller.

    Raises:
        ValueError: ``max_extend_events`` is negative.
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        *,
        engine_id: str,
        tp_rank: int,
        timing: LeaseTiming,
        kv_role: str = "kv_producer",
        clock: Callable[[], float] = time.perf_counter,
        max_extend_events: int = 64,
        observers: Sequence[LeaseObserver] = (),
    ):
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
        self._open: dict[str, _OpenLease] = {}
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()  # req_id -> (outcome, end s)
        self._ended_memory = 65536

    # -- queries ---------------------------------------------------------------------------
    def has(self, req_id: str) -> bool:
        """Whether a lease for ``req_id`` is open on this worker."""
        return req_id in self._open

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
        """How many open leases have a deadline less than ``seconds`` away (O(open leases))."""
        now = self._clock() if now is None else now
        limit = now + seconds
        return sum(1 for lease in self._open.values() if lease.deadline_s < limit)

    def _emit(self, kind: str, req_id: str, now: float, **fields) -> None:
        if not self._observers:
            return
        event = LeaseEvent(kind, req_id, self._engine_id, self._tp_rank, self._kv_role, now, **fields)
        for observer in self._observers:
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
        grant_s = deadline_s - self._timing.lease_duration_s
        attributes = {
            sc.REQUEST_ID: req_id,
            sc.ENGINE_ID: self._engine_id,
            sc.KV_ROLE: self._kv_role,
            sc.TP_RANK: self._tp_rank,
            sc.LEASE_DURATION_S: float(self._timing.lease_duration_s),
            sc.EXTENSION_S: float(self._timing.extension_s),
            sc.GRANT_MONOTONIC_S: grant_s,
            sc.INITIAL_DEADLINE_MONOTONIC_S: deadline_s,
        }
        if kv_blocks is not None:
            attributes[sc.KV_BLOCKS] = int(kv_blocks)
        span = self._tracer.start_span(
            sc.LEASE_SPAN_NAME,
            context=parent_context(trace_headers),
            kind=trace.SpanKind.INTERNAL,
            attributes=attributes,
        )
        span.add_event(
            sc.EVENT_GRANT,
            {sc.EV_MONOTONIC_S: now, sc.EV_DEADLINE_REMAINING_S: deadline_s - now},
        )
        self._open[req_id] = _OpenLease(span=span, deadline_s=deadline_s, grant_s=grant_s, kv_blocks=kv_blocks)
        self._emit(ev.GRANT, req_id, now, kv_blocks=kv_blocks, deadline_remaining_s=deadline_s - now)
        return True

    def annotate(self, req_id: str, attributes: Mapping[str, Any]) -> bool:
        """Set extra attributes on ``req_id``'s open span (e.g. chaos evidence). False if unknown."""
        lease = self._open.get(req_id)
        if lease is None:
            return False
        lease.span.set_attributes(dict(attributes))
        return True

    def extend(self, req_id: str, deadline_s: float, *, remote_agent: str | None = None, now: float | None = None) -> bool:
        """Record a delivered heartbeat naming ``req_id`` and the deadline it left. False if unknown."""
        lease = self._open.get(req_id)
        if lease is None:
            return False
        now = self._clock() if now is None else now
        gap_s = now - (lease.grant_s if lease.last_extend_s is None else lease.last_extend_s)
        lease.extend_count += 1
        lease.deadline_s = deadline_s
        lease.last_extend_s = now
        if remote_agent and lease.remote_agent is None:
            lease.remote_agent = remote_agent
            lease.span.set_attribute(sc.REMOTE_AGENT, remote_agent)
        if lease.extend_count <= self._max_extend_events:
            lease.span.add_event(
                sc.EVENT_EXTEND,
                {
                    sc.EV_MONOTONIC_S: now,
                    sc.EV_DEADLINE_REMAINING_S: deadline_s - now,
                    sc.EV_EXTEND_COUNT: lease.extend_count,
                },
            )
        else:
            lease.extend_events_dropped += 1
        self._emit(
            ev.EXTEND, req_id, now, remote_agent=lease.remote_agent, gap_s=gap_s, deadline_remaining_s=deadline_s - now
        )
        return True

    def retrieval(self, req_id: str, *, remote_agent: str | None = None, now: float | None = None) -> bool:
        """Record one read-completion notification (one consumer rank done). False if unknown."""
        lease = self._open.get(req_id)
        if lease is None:
            return False
        now = self._clock() if now is None else now
        lease.retrievals += 1
        if remote_agent and lease.remote_agent is None:
            lease.remote_agent = remote_agent
            lease.span.set_attribute(sc.REMOTE_AGENT, remote_agent)
        attributes = {sc.EV_MONOTONIC_S: now, sc.EV_RETRIEVALS: lease.retrievals}
        if remote_agent:
            attributes[sc.EV_REMOTE_AGENT] = remote_agent
        lease.span.add_event(sc.EVENT_RETRIEVAL, attributes)
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

    def late_read(self, req_id: str, *, remote_agent: str | None = None, now: float | None = None,
                  fail_closed: bool | None = None) -> bool:
        """Record a read completion for a lease that already ended (a zero-length
        ``kv_lease_late_read`` span; ``fail_closed``: the reading D discards the read, see
        :attr:`LeaseEvent.fail_closed`). False (nothing recorded) if ``req_id`` is open or unknown."""
        ended = self._ended.get(req_id)
        if ended is None or req_id in self._open:
            return False
        now = self._clock() if now is None else now
        outcome, end_s = ended
        attributes = {
            sc.REQUEST_ID: req_id,
            sc.ENGINE_ID: self._engine_id,
            sc.TP_RANK: self._tp_rank,
            sc.ENDED_OUTCOME: outcome,
            sc.END_MONOTONIC_S: end_s,
            sc.EV_MONOTONIC_S: now,
            sc.LATE_BY_S: now - end_s,
        }
        if remote_agent:
            attributes[sc.REMOTE_AGENT] = remote_agent
        if fail_closed is not None:
            attributes[sc.D_FAIL_CLOSED] = fail_closed
        self._tracer.start_span(sc.LATE_READ_SPAN_NAME, attributes=attributes).end()
        self._emit(ev.LATE_READ, req_id, now, remote_agent=remote_agent, outcome=outcome, late_by_s=now - end_s,
                   fail_closed=fail_closed)
        return True

    def abort_all(self, reason: str) -> int:
        """Abort every open lease (worker shutdown); returns how many were open."""
        ids = list(self._open)
        for req_id in ids:
            self.abort(req_id, reason)
        return len(ids)

    def _end(
        self,
        req_id: str,
        outcome: str,
        event: str,
        now: float | None,
        *,
        step_gap_s: float | None = None,
        reason: str | None = None,
        cause: str | None = None,
    ) -> bool:
        lease = self._open.pop(req_id, None)
        if lease is None:
            return False
        now = self._clock() if now is None else now
        span = lease.span
        event_attributes = {
            sc.EV_MONOTONIC_S: now,
            sc.EV_DEADLINE_REMAINING_S: lease.deadline_s - now,
            sc.EV_RETRIEVALS: lease.retrievals,
        }
        if reason:
            event_attributes[sc.ABORT_REASON] = reason
        span.add_event(event, event_attributes)
        attributes = {
            sc.OUTCOME: outcome,
            sc.END_MONOTONIC_S: now,
            sc.DEADLINE_MONOTONIC_S: lease.deadline_s,
            sc.EXTEND_COUNT: lease.extend_count,
            sc.EXTEND_EVENTS_DROPPED: lease.extend_events_dropped,
            sc.RETRIEVALS: lease.retrievals,
        }
        if lease.last_extend_s is not None:
            attributes[sc.LAST_EXTEND_MONOTONIC_S] = lease.last_extend_s
        expired = outcome == sc.OUTCOME_EXPIRED
        if not expired:
            cause = None
        elif cause is None:
            cause = ev.CAUSE_NO_HEARTBEAT if lease.extend_count == 0 else ev.CAUSE_HEARTBEAT_LAPSED
        if expired:
            attributes[sc.RECLAIM_LAG_S] = now - lease.deadline_s
            attributes[sc.EXPIRY_CAUSE] = cause
        if step_gap_s is not None:
            attributes[sc.STEP_GAP_S] = step_gap_s
        if reason:
            attributes[sc.ABORT_REASON] = reason
        span.set_attributes(attributes)
        span.end()
        self._ended[req_id] = (outcome, now)
        while len(self._ended) > self._ended_memory:
            self._ended.popitem(last=False)
        self._emit(
            event,
            req_id,
            now,
            kv_blocks=lease.kv_blocks,
            remote_agent=lease.remote_agent,
            deadline_remaining_s=lease.deadline_s - now,
            hold_s=now - lease.grant_s,
            outcome=outcome,
            cause=cause,
            reclaim_lag_s=now - lease.deadline_s if expired else None,
            step_gap_s=step_gap_s,
            reason=reason,
        )
        return True
