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
- :class:`LeaseKitPromMetrics` registers vLLM's ``vllm:nixl_*`` metrics unchanged (it is a
  ``NixlPromMetrics``) plus every metric in :mod:`leasekit.telemetry.metrics`, and records both.

Requires log stats enabled in vLLM (the default; ``--disable-log-stats`` turns every such metric off).
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
EXTENSIONS = "lk_extensions"  # [rank, remote_agent, gap_s]
ENDS = "lk_ends"  # [rank, outcome, hold_s, remote_agent, cause, reclaim_lag_s]
LATE = "lk_late"  # [rank, remote_agent]
HEARTBEATS = "lk_heartbeats"  # [rank, remote_engine_id, ok (1|0)]
STATE = "lk_state"  # [rank, active, pinned_blocks, expiring_soon]  latest wins
CONFIG = "lk_config"  # [rank, kv_role, L, H, E]
LEASE_KEYS = (GRANTS, EXTENSIONS, ENDS, LATE, HEARTBEATS, STATE, CONFIG)


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
        """Record ``event`` (a :class:`LeaseEvent`)."""
        data, rank = self.stats.data, self.tp_rank
        remote = event.remote_agent or m.UNKNOWN_REMOTE
        if event.kind == ev.GRANT:
            self.active += 1
            self.pinned_blocks += event.kv_blocks or 0
            data[GRANTS].append([rank])
        elif event.kind == ev.EXTEND:
            data[EXTENSIONS].append([rank, remote, float(event.gap_s or 0.0)])
        elif event.kind in (ev.RELEASE, ev.EXPIRE, ev.ABORT):
            self.active = max(0, self.active - 1)
            self.pinned_blocks = max(0, self.pinned_blocks - (event.kv_blocks or 0))
            data[ENDS].append(
                [rank, event.outcome, float(event.hold_s or 0.0), remote, event.cause or "", event.reclaim_lag_s]
            )
        elif event.kind == ev.LATE_READ:
            data[LATE].append([rank, remote])

    def heartbeat(self, remote_engine_id: str, ok: bool) -> None:
        """Record one heartbeat notification D sent (``ok``) or failed to send to ``remote_engine_id``."""
        self.stats.data[HEARTBEATS].append([self.tp_rank, str(remote_engine_id), 1 if ok else 0])

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


class LeaseKitPromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus the lease metrics of :mod:`leasekit.telemetry.metrics`.

    Built by vLLM in the API server process (``LeaseKitConnector.build_prom_metrics``) with its
    metric classes (``metric_types``), its label names (``model_name``, ``engine``) and the label
    values of each engine index; lease metrics add the labels the catalog declares.
    """

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls}
        self._lk: dict[str, Any] = {}
        for spec in m.LEASEKIT_METRICS:
            kwargs: dict[str, Any] = {
                "name": spec.name,
                "documentation": spec.help,
                "labelnames": list(labelnames) + list(spec.labels),
            }
            if spec.kind == "histogram":
                kwargs["buckets"] = list(spec.buckets)
            if spec.kind == "gauge":
                kwargs["multiprocess_mode"] = "mostrecent"
            self._lk[spec.name] = classes[spec.kind](**kwargs)

    def _child(self, spec: m.MetricSpec, engine_idx: int, *values: object) -> Any:
        engine_values = self.per_engine_labelvalues.get(engine_idx, [])
        return self._lk[spec.name].labels(*[str(v) for v in (*engine_values, *values)])

    def _zero_series(self, engine_idx: int, rank: object, kv_role: str) -> None:
        """Export every series this worker's role can produce at zero (Prometheus instrumentation
        practice: "avoid missing metrics"), so rates and alerts see 0, not absence, before the first
        event. Remote peers are not known yet: their series start under ``remote_*="unknown"``."""
        sides = {"kv_producer": ("P",), "kv_consumer": ("D",)}.get(kv_role, ("P", "D"))
        for spec in m.LEASEKIT_METRICS:
            if spec.side not in sides or "kv_role" in spec.labels:
                continue
            extra: list[list[str]] = [[]]
            for label in spec.labels[1:]:  # tp_rank first
                values = {"cause": m.EXPIRY_CAUSES, "outcome": m.HOLD_OUTCOMES}.get(label, (m.UNKNOWN_REMOTE,))
                extra = [e + [v] for e in extra for v in values]
            for values in extra:
                self._child(spec, engine_idx, rank, *values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record vLLM's NIXL observations, then every ``lk_*`` list (see module docstring)."""
        super().observe(transfer_stats_data, engine_idx)
        d = transfer_stats_data
        for (rank,) in d.get(GRANTS, ()):
            self._child(m.GRANTS, engine_idx, rank).inc()
        for rank, remote, gap_s in d.get(EXTENSIONS, ()):
            self._child(m.EXTENSIONS, engine_idx, rank, remote).inc()
            self._child(m.HEARTBEAT_GAP, engine_idx, rank).observe(gap_s)
        for rank, outcome, hold_s, remote, cause, lag_s in d.get(ENDS, ()):
            self._child(m.HOLD, engine_idx, rank, outcome).observe(hold_s)
            if outcome == "released":
                self._child(m.RELEASES, engine_idx, rank).inc()
            elif outcome == "expired":
                self._child(m.EXPIRIES, engine_idx, rank, remote, cause).inc()
                if lag_s is not None:
                    self._child(m.RECLAIM_LAG, engine_idx, rank).observe(max(0.0, lag_s))
            else:
                self._child(m.ABORTS, engine_idx, rank).inc()
        for rank, remote in d.get(LATE, ()):
            self._child(m.LATE_COMPLETIONS, engine_idx, rank, remote).inc()
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
