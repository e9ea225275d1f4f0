"""The stats methods LeaseKitConnector and LeaseKitPushConnector share (vLLM's ``KVConnectorBase_V1`` stats hooks:
``get_kv_connector_stats``, ``build_kv_connector_stats``, ``build_prom_metrics``)."""

from __future__ import annotations

from typing import Any

from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseKitPromMetrics


class LeaseKitConnectorStatsMixin:
    """The stats methods LeaseKitConnector and LeaseKitPushConnector share, first in their bases (before vLLM's
    NIXL connector): ``_lk_mode`` (``"pull"`` or ``"push"``) is the ``mode`` label of their lease metrics."""

    _lk_mode = "pull"

    def get_kv_connector_stats(self) -> Any:
        """Worker role: stock (the worker's NIXL and lease stats). Scheduler role: the handshake
        listener's health when it changed (``listener_stats`` of LeaseKit's scheduler), else None;
        vLLM's scheduler aggregates it with the workers' stats every step."""
        if self.connector_scheduler is not None:
            return self.connector_scheduler.listener_stats()
        return super().get_kv_connector_stats()  # type: ignore[misc]

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LeaseKitKVConnectorStats:
        """vLLM rebuilds the workers' stats in the API server with this (NIXL's plus lease lists)."""
        return LeaseKitKVConnectorStats(data=data) if data is not None else LeaseKitKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LeaseKitPromMetrics:
        """vLLM's NIXL metrics plus the lease metrics (:mod:`leasekit.telemetry.metrics`) on /metrics, every lease
        metric labelled ``mode`` = ``cls._lk_mode``."""
        return LeaseKitPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, mode=cls._lk_mode)
