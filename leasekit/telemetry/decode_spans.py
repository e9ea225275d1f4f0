"""D-side heartbeat spans: one span per request D keeps a lease alive for.

D starts tracking a request in its scheduler's ``on_new_request`` and sends ``HB:<ids>`` for it
every ``H`` seconds until ``_stop_heartbeat`` (vllm 0.32.0 ``nixl/base_scheduler.py``). The span
covers that interval and counts the heartbeat notifications naming the request (one attribute,
not one event per heartbeat: span volume stays O(requests)). ``gen_ai.request.id`` is P's request
id, the id the heartbeats carry and P's ``kv_lease`` span is keyed on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

from opentelemetry import trace

from leasekit.telemetry import semconv as sc
from leasekit.telemetry.tracecontext import parent_context


@dataclass(slots=True)
class _Tracked:
    span: trace.Span
    tracked_s: float
    decode_request_id: str | None = None
    sent: int = 0
    first_s: float | None = None
    last_s: float | None = None
    longest_silence_s: float = 0.0


class HeartbeatSpanRecorder:
    """Spans for the requests one D worker heartbeats. Methods never raise for unknown ids.

    Args:
        tracer: the tracer to start spans on.
        engine_id: this D engine's id; tp_rank: this worker's rank; kv_role: its vLLM ``kv_role``.
        clock: seconds (``time.perf_counter``, the clock of the recorded ``*_monotonic_s``).
    """

    def __init__(self, tracer: trace.Tracer, *, engine_id: str, tp_rank: int, kv_role: str = "kv_consumer",
                 clock: Callable[[], float] = time.perf_counter):
        self._tracer = tracer
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._kv_role = kv_role
        self._clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._by_decode: dict[str, str] = {}  # D request id -> P request id, for the tracked ones

    @property
    def tracked(self) -> int:
        """How many requests are being tracked."""
        return len(self._tracked)

    def track(self, remote_request_id: str, *, remote_engine_id: str, decode_request_id: str | None = None,
              trace_headers: Mapping[str, str] | None = None, now: float | None = None) -> bool:
        """Open the span for P's request ``remote_request_id``. False if already tracked."""
        if remote_request_id in self._tracked:
            return False
        now = self._clock() if now is None else now
        attributes = {
            sc.REQUEST_ID: remote_request_id,
            sc.ENGINE_ID: self._engine_id,
            sc.KV_ROLE: self._kv_role,
            sc.TP_RANK: self._tp_rank,
            sc.REMOTE_ENGINE_ID: remote_engine_id,
        }
        if decode_request_id:
            attributes[sc.DECODE_REQUEST_ID] = decode_request_id
        span = self._tracer.start_span(sc.HEARTBEATS_SPAN_NAME, context=parent_context(trace_headers),
                                       attributes=attributes)
        span.add_event(sc.EVENT_TRACKED, {sc.EV_MONOTONIC_S: now})
        self._tracked[remote_request_id] = _Tracked(span, now, decode_request_id)
        if decode_request_id:
            self._by_decode[decode_request_id] = remote_request_id
        return True

    def sent(self, remote_request_ids, *, now: float | None = None) -> int:
        """Count one heartbeat notification naming each id; returns how many ids were tracked."""
        now = self._clock() if now is None else now
        counted = 0
        for rid in remote_request_ids:
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            counted += 1
            tracked.sent += 1
            tracked.longest_silence_s = max(tracked.longest_silence_s,
                                            now - (tracked.tracked_s if tracked.last_s is None else tracked.last_s))
            if tracked.first_s is None:
                tracked.first_s = now
                tracked.span.add_event(sc.EVENT_FIRST_HEARTBEAT, {sc.EV_MONOTONIC_S: now})
            tracked.last_s = now
        return counted

    def longest_silence_s(self, decode_request_id: str, *, now: float | None = None) -> float | None:
        """The longest interval, in seconds, during which D sent no heartbeat naming the request D calls
        ``decode_request_id`` since it began tracking it, the interval still open at ``now`` included
        (:func:`leasekit.lease.bounds.silence_may_expire` judges it); None when that request is not tracked."""
        remote = self._by_decode.get(decode_request_id)
        tracked = None if remote is None else self._tracked.get(remote)
        if tracked is None:
            return None
        now = self._clock() if now is None else now
        return max(tracked.longest_silence_s, now - (tracked.tracked_s if tracked.last_s is None else tracked.last_s))

    def note(self, decode_request_id: str, event: str, attributes: Mapping[str, object]) -> bool:
        """Add ``event`` with ``attributes`` to the heartbeat span of the request D calls ``decode_request_id``;
        False when it is not tracked."""
        remote = self._by_decode.get(decode_request_id)
        tracked = None if remote is None else self._tracked.get(remote)
        if tracked is None:
            return False
        tracked.span.add_event(event, dict(attributes))
        return True

    def context_of(self, remote_request_id: str):
        """An OpenTelemetry context with the request's open heartbeat span as parent (to put D's other
        spans of the request in its trace), or None when it is not tracked."""
        tracked = self._tracked.get(remote_request_id)
        return None if tracked is None else trace.set_span_in_context(tracked.span)

    def untrack(self, remote_request_id: str, reason: str = "stopped tracking", *, now: float | None = None) -> bool:
        """End the span (D no longer heartbeats the request). False if not tracked."""
        tracked = self._tracked.pop(remote_request_id, None)
        if tracked is None:
            return False
        if tracked.decode_request_id and self._by_decode.get(tracked.decode_request_id) == remote_request_id:
            del self._by_decode[tracked.decode_request_id]
        now = self._clock() if now is None else now
        attributes = {sc.HEARTBEATS_SENT: tracked.sent, sc.END_MONOTONIC_S: now, sc.END_REASON: reason}
        if tracked.first_s is not None:
            attributes[sc.FIRST_HEARTBEAT_MONOTONIC_S] = tracked.first_s
            attributes[sc.LAST_HEARTBEAT_MONOTONIC_S] = tracked.last_s
        tracked.span.add_event(sc.EVENT_UNTRACKED, {sc.EV_MONOTONIC_S: now, sc.END_REASON: reason})
        tracked.span.set_attributes(attributes)
        tracked.span.end()
        return True

    def untrack_all(self, reason: str) -> int:
        """End every open span (worker shutdown); returns how many were open."""
        ids = list(self._tracked)
        for rid in ids:
            self.untrack(rid, reason)
        return len(ids)
