"""Late spans of the lease span recorder (:class:`leasekit.telemetry.lease_spans.LeaseSpanRecorder`): a zero-length
span for something that happened to a lease after it ended: a read completion (``kv_lease_late_read``, pull mode)
or a WRITE that finished (``kv_lease_late_write``, push mode)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from leasekit.lease.peerref import peer_ref
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry import semconv as sc


class LateSpans:
    """A base of :class:`~leasekit.telemetry.lease_spans.LeaseSpanRecorder`; uses its ``_ended`` (req_id ->
    (outcome, end instant)), ``_open``, ``_clock``, ``_spans``, ``_tracer``, ``_engine_id``, ``_tp_rank`` and
    ``_emit``. Instants are seconds on the worker's ``perf_counter``."""

    _ended: Any
    _open: Any
    _clock: Any
    _spans: Any
    _tracer: Any
    _engine_id: str
    _tp_rank: int

    def late_read(self, req_id: str, *, remote_agent: str | None = None, now: float | None = None,
                  fail_closed: bool | None = None) -> bool:
        """Record a read completion of ``remote_agent`` (recorded as its peer reference) for a lease that
        already ended (a zero-length ``kv_lease_late_read`` span; ``fail_closed``: the reading D discards the
        read, see :attr:`LeaseEvent.fail_closed`). False (nothing recorded) if ``req_id`` is open or unknown."""
        late = self._late(req_id, now, sc.LATE_READ_SPAN_NAME, remote_agent=remote_agent, fail_closed=fail_closed)
        if late is None:
            return False
        now, outcome, late_by_s, ref = late
        self._emit(ev.LATE_READ, req_id, now, remote_agent=ref, outcome=outcome, late_by_s=late_by_s,
                   fail_closed=fail_closed)
        return True

    def late_write(self, req_id: str, *, now: float | None = None) -> bool:
        """Record that a push-mode WRITE of ``req_id``'s blocks finished after its lease ended (P had freed the
        source blocks; D may hold reused data): a zero-length ``kv_lease_late_write`` span, no observer event (the
        push worker counts it). False (nothing recorded) if ``req_id`` is open or unknown."""
        return self._late(req_id, now, sc.LATE_WRITE_SPAN_NAME) is not None

    def _late(self, req_id: str, now: float | None, name: str, *, remote_agent: str | None = None,
              fail_closed: bool | None = None) -> tuple[float, str, float, str | None] | None:
        """Submit a zero-length late span ``name`` for an ended lease; ``(now, outcome, late_by_s, peer ref)``."""
        ended = self._ended.get(req_id)
        if ended is None or req_id in self._open:
            return None
        now = self._clock() if now is None else now
        outcome, end_s = ended
        attributes = {sc.REQUEST_ID: req_id, sc.ENGINE_ID: self._engine_id, sc.TP_RANK: self._tp_rank,
                      sc.ENDED_OUTCOME: outcome, sc.END_MONOTONIC_S: end_s, sc.EV_MONOTONIC_S: now,
                      sc.LATE_BY_S: now - end_s}
        ref = peer_ref(remote_agent) if remote_agent else None
        if ref:
            attributes[sc.REMOTE_AGENT] = ref
        if fail_closed is not None:
            attributes[sc.D_FAIL_CLOSED] = fail_closed
        self._spans.submit(partial(self._late_span, attributes, time.time_ns(), name))
        return now, outcome, now - end_s, ref

    def _late_span(self, attributes: dict[str, Any], at_ns: int, name: str) -> None:
        self._tracer.start_span(name, attributes=attributes, start_time=at_ns).end(end_time=at_ns)
