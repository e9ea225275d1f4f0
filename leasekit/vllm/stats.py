"""Lease metrics through vLLM's own connector-stats path, onto the ``/metrics`` users already scrape.

Workers run in other processes than the API server. vLLM (0.32.0) already ships connector stats
from each worker to the API server: the worker's ``get_kv_connector_stats()`` goes into the step
output (``vllm/v1/worker/kv_connector_model_runner_mixin.py``), is aggregated over TP workers and
sent with ``SchedulerStats.kv_connector_stats`` (``vllm/v1/core/sched/scheduler.py: make_stats``),
and the API server's ``PrometheusStatLogger`` passes the dict to the connector class's
``build_prom_metrics(...).observe(data, engine_idx)`` (``vllm/v1/metrics/loggers.py``). So:

- :class:`LeaseKitKVConnectorStats` is NIXL's stats container plus ``lk_*`` lists of lease
  observations (each entry starts with the worker's TP rank);
- :class:`LeaseStatsObserver` appends to it on every :class:`~leasekit.telemetry.lease_events.LeaseEvent`;
- :class:`ListenerStatsReporter` adds, from the scheduler (not a worker), the handshake listener's
  health (``lk_listener``, :mod:`leasekit.vllm.prefill.listener`);
- :class:`LeaseKitPromMetrics` registers vLLM's ``vllm:nixl_*`` metrics unchanged (it is a
  ``NixlPromMetrics``) plus every metric in :mod:`leasekit.telemetry.metrics`, and records both.

Requires log stats enabled in vLLM (the default; ``--disable-log-stats`` turns every such metric off).

No entry carries a request id or a NIXL agent name: only the closed label values of the catalog (TP rank,
kv_role, outcome, cause, peer state, reason, ...) and, on D, the P engine id heartbeats go to. So nothing a
peer claims about itself, and nothing that grows with requests or D restarts, can reach ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

from leasekit.lease.config import LeaseTiming
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry import metrics as m
from leasekit.telemetry.lease_events import LeaseEvent

# Keys of the lk_* lists; entries are lists (msgpack-serialisable), rank first.
GRANTS = "lk_grants"  # [rank]
EXTENSIONS = "lk_extensions"  # [rank, gap_s]
ENDS = "lk_ends"  # [rank, outcome, hold_s, cause, peer_state, reclaim_lag_s]
LATE = "lk_late"  # [rank, fail_closed ("true"|"false")]
PEER_RETURNS = "lk_peer_returns"  # [rank, count]  silent expiries whose D agent was heard from again
HEARTBEATS = "lk_heartbeats"  # [rank, remote_engine_id, ok (1|0)]
STATE = "lk_state"  # [rank, active, pinned_blocks, expiring_soon]  latest wins
CONFIG = "lk_config"  # [rank, kv_role, L, H, E]
DROPS = "lk_drops"  # [rank, reason, count]  one entry per reason per step (a flood stays small)
MAX_HOLD = "lk_max_hold"  # [rank, kv_role, max_hold_s]
READS = "lk_reads"  # [rank, outcome, wait_s, proof]  D's read gate, one per decided read (proof: verified only)
VERDICT_FAILS = "lk_verdict_fails"  # [rank]  P failed to send a read verdict
PLEDGE_HOLDS = "lk_pledge_holds"  # [rank, held_s]  P kept a completed lease's blocks until its pledge ended
SPAN_DROPS = "lk_span_drops"  # [rank, reason, count]  spans not exported since the last step
BINDINGS = "lk_bindings"  # [rank, proof, count]  one entry per kind per step
UNKNOWN_IDS = "lk_unknown_ids"  # [rank, count]  heartbeat ids P held no lease for
LISTENER = "lk_listener"  # [up (1|0), served_total, {reason: total}]  scheduler side, no rank; latest wins
PUSH_WRITES = "lk_push_writes"  # [rank, outcome, count]  P's WRITEs in push mode (issued, done, failed, late, refused)
LATE_WRITES = "lk_late_writes"  # [rank, count]  D: WRITE notifications for requests D no longer waited on
WITHHELD = "lk_withheld"  # [rank, count]  D: push registrations withheld (D fell silent on the lease)
LEASE_KEYS = (GRANTS, EXTENSIONS, ENDS, LATE, PEER_RETURNS, HEARTBEATS, STATE, CONFIG, DROPS, MAX_HOLD, READS,
              VERDICT_FAILS, PLEDGE_HOLDS, SPAN_DROPS, BINDINGS, UNKNOWN_IDS, LISTENER, PUSH_WRITES, LATE_WRITES,
              WITHHELD)


class LeaseKitKVConnectorStats(NixlKVConnectorStats):
    """vLLM's NIXL stats container (``data`` of lists) plus the ``lk_*`` lease lists.

    Aggregation over workers concatenates lists, as NIXL's does; :meth:`is_empty` is False while any
    lease observation is pending, so vLLM ships it even in steps without a transfer."""

    def reset(self) -> None:
        """Empty every list (vLLM calls it after each ``clone_and_reset``)."""
        super().reset()
        for key in LEASE_KEYS:
            self.data[key] = []

    def is_empty(self) -> bool:
        """True when neither NIXL nor lease observations are pending."""
        return super().is_empty() and not any(self.data.get(key) for key in LEASE_KEYS)

    def aggregate(self, other: Any) -> "LeaseKitKVConnectorStats":
        """Concatenate ``other``'s lists onto ours (keys missing on either side are created)."""
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self


class LeaseStatsObserver:
    """Appends each lease event of one worker to a :class:`LeaseKitKVConnectorStats`, and keeps the
    worker's active-lease and pinned-block totals for the gauges.

    Args:
        stats: the worker's stats container (vLLM's ``xfer_stats``).
        tp_rank: the worker's TP rank (first element of every entry).
    """

    def __init__(self, stats: LeaseKitKVConnectorStats, tp_rank: int):
        self.stats = stats
        self.tp_rank = tp_rank
        self.active = 0
        self.pinned_blocks = 0
        self._last_state: tuple[int, int, int] | None = None

    def __call__(self, event: LeaseEvent) -> None:
        """Record ``event`` (a :class:`LeaseEvent`); its request id and peer reference are not recorded."""
        data, rank = self.stats.data, self.tp_rank
        if event.kind == ev.GRANT:
            self.active += 1
            self.pinned_blocks += event.kv_blocks or 0
            data[GRANTS].append([rank])
        elif event.kind == ev.EXTEND:
            data[EXTENSIONS].append([rank, float(event.gap_s or 0.0)])
        elif event.kind in (ev.RELEASE, ev.EXPIRE, ev.ABORT):
            self.active = max(0, self.active - 1)
            self.pinned_blocks = max(0, self.pinned_blocks - (event.kv_blocks or 0))
            data[ENDS].append(
                [rank, event.outcome, float(event.hold_s or 0.0), event.cause or "", event.peer_state or "",
                 event.reclaim_lag_s]
            )
        elif event.kind == ev.LATE_READ:
            data[LATE].append([rank, "true" if event.fail_closed else "false"])
        elif event.kind == ev.PEER_RETURNED:
            data[PEER_RETURNS].append([rank, int(event.count or 0)])

    def on_extend(self, gap_s: float) -> None:
        """Record one extension (a delivered heartbeat naming a live lease): ``gap_s`` seconds since the
        lease's previous heartbeat or its grant. The fast path of ``__call__`` for EXTEND events."""
        self.stats.data[EXTENSIONS].append([self.tp_rank, gap_s])

    def heartbeat(self, remote_engine_id: str, ok: bool) -> None:
        """Record one heartbeat notification D sent (``ok``) or failed to send to ``remote_engine_id``."""
        self.stats.data[HEARTBEATS].append([self.tp_rank, str(remote_engine_id), 1 if ok else 0])

    def dropped(self, reason: str, count: int = 1) -> None:
        """Record ``count`` notifications (or, ``bad_heartbeat_id``, heartbeat ids) P dropped (``reason``: one of
        ``metrics.NOTIFICATION_DROP_REASONS``)."""
        self._add(DROPS, str(reason), count)

    def binding(self, proof: str) -> None:
        """Record that P bound one lease by ``proof`` (``proven`` or ``plain``, ``metrics.PROOF_KINDS``)."""
        self._add(BINDINGS, str(proof), 1)

    def heartbeat_unknown_ids(self, count: int) -> None:
        """Record ``count`` heartbeat ids P held no lease for."""
        entries = self.stats.data[UNKNOWN_IDS]
        if entries:
            entries[0][1] += int(count)
        else:
            entries.append([self.tp_rank, int(count)])

    def push_write(self, outcome: str) -> None:
        """Record one push-mode WRITE of P by ``outcome`` (``issued``, ``done``, ``failed``, ``late``, ``refused``:
        ``metrics.PUSH_WRITE_OUTCOMES``)."""
        self._add(PUSH_WRITES, str(outcome), 1)

    def late_write(self) -> None:
        """Record one WRITE notification D got for a request it no longer waited on (push mode)."""
        self._count_one(LATE_WRITES)

    def registration_withheld(self) -> None:
        """Record one push registration D withheld (push mode, :meth:`leasekit.vllm.push.LeaseKitPushWorker._lk_withhold_lapsed`)."""
        self._count_one(WITHHELD)

    def _count_one(self, key: str) -> None:
        """Add 1 to this rank's ``[rank, count]`` entry of ``key`` (one entry per step)."""
        entries = self.stats.data[key]
        if entries:
            entries[0][1] += 1
        else:
            entries.append([self.tp_rank, 1])

    def _add(self, key: str, label: str, count: int) -> None:
        entries = self.stats.data[key]
        for entry in entries:
            if entry[1] == label:
                entry[2] += int(count)
                return
        entries.append([self.tp_rank, label, int(count)])

    def read(self, outcome: str, wait_s: float, proof: str | None = None) -> None:
        """Record one read D's gate decided (``outcome``: one of ``metrics.READ_OUTCOMES``; ``wait_s``:
        seconds the read was held back; ``proof``: for a verified read, one of ``metrics.READ_PROOFS``)."""
        self.stats.data[READS].append([self.tp_rank, str(outcome), float(wait_s), proof])

    def pledge_hold(self, held_s: float) -> None:
        """Record that P kept a completed lease's blocks pinned ``held_s`` seconds more for its pledge."""
        self.stats.data[PLEDGE_HOLDS].append([self.tp_rank, float(held_s)])

    def spans_dropped(self, reason: str, count: int) -> None:
        """Record ``count`` spans not exported since the last report (``reason``: one of
        ``metrics.SPAN_DROP_REASONS``)."""
        self.stats.data[SPAN_DROPS].append([self.tp_rank, str(reason), int(count)])

    def verdict_send_failed(self) -> None:
        """Record one read verdict P failed to send."""
        self.stats.data[VERDICT_FAILS].append([self.tp_rank])

    def max_hold(self, kv_role: str, max_hold_s: float) -> None:
        """Queue the configured max hold (seconds) for its gauge."""
        self.stats.data[MAX_HOLD].append([self.tp_rank, kv_role, float(max_hold_s)])

    def state(self, expiring_soon: int) -> None:
        """Queue a gauge snapshot (active, pinned blocks, ``expiring_soon``) if it changed."""
        snapshot = (self.active, self.pinned_blocks, expiring_soon)
        if snapshot != self._last_state:
            self._last_state = snapshot
            self.stats.data[STATE].append([self.tp_rank, *snapshot])

    def config(self, kv_role: str, timing: LeaseTiming) -> None:
        """Queue the configured L, H, E (seconds) for the config gauges."""
        self.stats.data[CONFIG].append(
            [self.tp_rank, kv_role, float(timing.lease_duration_s), float(timing.heartbeat_interval_s),
             float(timing.extension_s)]
        )


class ListenerStatsReporter:
    """Scheduler side (P's engine process): reports the NIXL handshake listener's health through
    the same connector-stats path as the workers' lease lists.

    vLLM's scheduler calls the SCHEDULER-role connector's ``get_kv_connector_stats()`` after every
    engine step and aggregates a non-empty result with the workers' stats (vllm 0.32.0
    ``v1/core/sched/scheduler.py: update_from_output``), so a report reaches ``/metrics`` at P's next
    step; an idle P (no step) shows the last report.
    """

    def __init__(self) -> None:
        self._last: tuple[int, int, dict[str, int]] | None = None

    def report(self, up: bool, served: int, bad: dict[str, int]) -> LeaseKitKVConnectorStats | None:
        """A stats container with one ``lk_listener`` entry ``[up 1|0, served, {reason: count}]``
        (totals since the engine started) if any of them changed since the last report, else None."""
        entry = (1 if up else 0, int(served), dict(bad))
        if entry == self._last:
            return None
        self._last = entry
        stats = LeaseKitKVConnectorStats()
        stats.data[LISTENER].append([entry[0], entry[1], entry[2]])
        return stats


class LeaseKitPromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus the lease metrics of :mod:`leasekit.telemetry.metrics`.

    Built by vLLM in the API server process (``LeaseKitConnector.build_prom_metrics``) with its
    metric classes (``metric_types``), its label names (``model_name``, ``engine``) and the label
    values of each engine index; lease metrics add the labels the catalog declares.
    """

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], mode: str = "pull"):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        if mode not in m.TRANSFER_MODES:
            raise ValueError(f"mode={mode!r}: must be one of {m.TRANSFER_MODES}")
        self._lk_mode = mode
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls}
        self._lk: dict[str, Any] = {}
        self._lk_listener_last: dict[int, tuple[int, dict[str, int]]] = {}  # engine -> last totals
        for spec in m.LEASEKIT_METRICS:
            kwargs: dict[str, Any] = {
                "name": spec.name,
                "documentation": spec.help,
                "labelnames": list(labelnames) + [m.MODE_LABEL] + list(spec.labels),
            }
            if spec.kind == "histogram":
                kwargs["buckets"] = list(spec.buckets)
            if spec.kind == "gauge":
                kwargs["multiprocess_mode"] = "mostrecent"
            self._lk[spec.name] = classes[spec.kind](**kwargs)

    def _child(self, spec: m.MetricSpec, engine_idx: int, *values: object) -> Any:
        engine_values = self.per_engine_labelvalues.get(engine_idx, [])
        return self._lk[spec.name].labels(*[str(v) for v in (*engine_values, self._lk_mode, *values)])

    def _zero_series(self, engine_idx: int, rank: object, kv_role: str) -> None:
        """Export every series this worker's role can produce at zero (Prometheus instrumentation
        practice: "avoid missing metrics"), so rates and alerts see 0, not absence, before the first
        event. Every P-side label is a closed set, so every series exists from the start; on D the P engines
        are not known yet: their series start under ``remote_engine_id="unknown"``."""
        sides = {"kv_producer": ("P",), "kv_consumer": ("D",)}.get(kv_role, ("P", "D"))
        for spec in m.LEASEKIT_METRICS:
            if spec.side not in sides + ("both",) or "kv_role" in spec.labels:
                continue
            if spec.labels[:1] != ("tp_rank",):  # not per rank (the scheduler's listener): zeroed by
                continue                          # its own entry, see _listener
            if spec.modes != m.TRANSFER_MODES and self._lk_mode not in spec.modes:
                continue
            extra: list[list[str]] = [[]]
            for label in spec.labels[1:]:  # tp_rank first
                values = {"cause": m.EXPIRY_CAUSES, "peer_state": m.PEER_STATES,
                          "outcome": (m.READ_OUTCOMES if spec is m.READS else m.PUSH_WRITE_OUTCOMES
                                      if spec is m.PUSH_WRITES_METRIC else m.HOLD_OUTCOMES),
                          "proof": m.PROOF_KINDS if spec is m.BINDINGS else m.READ_PROOFS,
                          "reason": m.SPAN_DROP_REASONS if spec is m.SPANS_DROPPED else m.NOTIFICATION_DROP_REASONS,
                          "fail_closed": ("false",)}.get(label, (m.UNKNOWN_REMOTE,))
                extra = [e + [v] for e in extra for v in values]
            for values in extra:
                self._child(spec, engine_idx, rank, *values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record vLLM's NIXL observations, then every ``lk_*`` list (see module docstring)."""
        super().observe(transfer_stats_data, engine_idx)
        d = transfer_stats_data
        for (rank,) in d.get(GRANTS, ()):
            self._child(m.GRANTS, engine_idx, rank).inc()
        for rank, gap_s in d.get(EXTENSIONS, ()):
            self._child(m.EXTENSIONS, engine_idx, rank).inc()
            self._child(m.HEARTBEAT_GAP, engine_idx, rank).observe(gap_s)
        for rank, outcome, hold_s, cause, peer_state, lag_s in d.get(ENDS, ()):
            self._child(m.HOLD, engine_idx, rank, outcome).observe(hold_s)
            if outcome == "released":
                self._child(m.RELEASES, engine_idx, rank).inc()
            elif outcome == "expired":
                self._child(m.EXPIRIES, engine_idx, rank, cause, peer_state).inc()
                if lag_s is not None:
                    self._child(m.RECLAIM_LAG, engine_idx, rank).observe(max(0.0, lag_s))
            else:
                self._child(m.ABORTS, engine_idx, rank).inc()
        for rank, fail_closed in d.get(LATE, ()):
            self._child(m.LATE_COMPLETIONS, engine_idx, rank, "true" if fail_closed == "true" else "false").inc()
        for rank, count in d.get(PEER_RETURNS, ()):
            self._child(m.EXPIRED_PEER_RETURNS, engine_idx, rank).inc(count)
        for rank, remote_engine, ok in d.get(HEARTBEATS, ()):
            spec = m.HEARTBEATS_SENT if ok else m.HEARTBEAT_SEND_FAILURES
            self._child(spec, engine_idx, rank, remote_engine).inc()
        for rank, active, pinned, soon in d.get(STATE, ()):  # in order: the last one wins
            self._child(m.LEASES_ACTIVE, engine_idx, rank).set(active)
            self._child(m.PINNED_BLOCKS, engine_idx, rank).set(pinned)
            self._child(m.EXPIRING_SOON, engine_idx, rank).set(soon)
        for rank, role, lease_s, interval_s, extension_s in d.get(CONFIG, ()):
            self._zero_series(engine_idx, rank, role)
            self._child(m.DURATION, engine_idx, role).set(lease_s)
            self._child(m.HEARTBEAT_INTERVAL, engine_idx, role).set(interval_s)
            self._child(m.EXTENSION, engine_idx, role).set(extension_s)
        for rank, reason, count in d.get(DROPS, ()):
            if reason in m.NOTIFICATION_DROP_REASONS:  # a bounded label set, whatever arrives
                self._child(m.NOTIFICATIONS_DROPPED, engine_idx, rank, reason).inc(count)
        for rank, proof, count in d.get(BINDINGS, ()):
            if proof in m.PROOF_KINDS:
                self._child(m.BINDINGS, engine_idx, rank, proof).inc(count)
        for rank, count in d.get(UNKNOWN_IDS, ()):
            self._child(m.HEARTBEAT_UNKNOWN_IDS, engine_idx, rank).inc(count)
        for rank, outcome, wait_s, *proof in d.get(READS, ()):
            self._child(m.READS, engine_idx, rank, outcome).inc()
            if proof and proof[0] in m.READ_PROOFS:
                self._child(m.READ_PROOFS_METRIC, engine_idx, rank, proof[0]).inc()
            if outcome not in ("unprotected", "abandoned", "pushed"):  # the protocol's cost, not a client's abort
                self._child(m.READ_VERDICT_WAIT, engine_idx, rank).observe(wait_s)
        for rank, reason, count in d.get(SPAN_DROPS, ()):
            if reason in m.SPAN_DROP_REASONS:
                self._child(m.SPANS_DROPPED, engine_idx, rank, reason).inc(count)
        for (rank,) in d.get(VERDICT_FAILS, ()):
            self._child(m.VERDICT_SEND_FAILURES, engine_idx, rank).inc()
        for rank, held_s in d.get(PLEDGE_HOLDS, ()):
            self._child(m.PLEDGE_HOLD, engine_idx, rank).observe(held_s)
        for _rank, role, max_hold_s in d.get(MAX_HOLD, ()):
            self._child(m.MAX_HOLD, engine_idx, role).set(max_hold_s)
        for rank, outcome, count in d.get(PUSH_WRITES, ()):
            if outcome in m.PUSH_WRITE_OUTCOMES:
                self._child(m.PUSH_WRITES_METRIC, engine_idx, rank, outcome).inc(count)
        for rank, count in d.get(LATE_WRITES, ()):
            self._child(m.PUSH_LATE_WRITES, engine_idx, rank).inc(count)
        for rank, count in d.get(WITHHELD, ()):
            self._child(m.PUSH_WITHHELD, engine_idx, rank).inc(count)
        for up, served, bad in d.get(LISTENER, ()):  # in order: the last one wins
            self._listener(engine_idx, up, served, bad)

    def _listener(self, engine_idx: int, up: int, served: int, bad: dict[str, int]) -> None:
        """Record one handshake-listener report (totals since the engine started) of ``engine_idx``:
        the gauge takes ``up``; counters grow by the increase since the previous report (the new
        total when it went down: a restarted engine). The first report creates every series at 0."""
        last_served, last_bad = self._lk_listener_last.get(engine_idx, (0, {}))
        if engine_idx not in self._lk_listener_last:
            self._child(m.HANDSHAKE_REQUESTS, engine_idx)
            for reason in m.HANDSHAKE_BAD_REASONS:
                self._child(m.HANDSHAKE_BAD_REQUESTS, engine_idx, reason)
        self._child(m.HANDSHAKE_LISTENER_UP, engine_idx).set(1 if up else 0)
        increase = served - last_served if served >= last_served else served
        if increase:
            self._child(m.HANDSHAKE_REQUESTS, engine_idx).inc(increase)
        for reason, total in bad.items():
            before = last_bad.get(reason, 0)
            increase = total - before if total >= before else total
            if increase and reason in m.HANDSHAKE_BAD_REASONS:  # a bounded label set, whatever arrives
                self._child(m.HANDSHAKE_BAD_REQUESTS, engine_idx, reason).inc(increase)
        self._lk_listener_last[engine_idx] = (served, dict(bad))
