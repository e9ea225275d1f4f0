"""Grafana dashboards and Prometheus rules for the KV lease, generated from Python and checked
against the metric catalog (:mod:`leasekit.telemetry.metrics`).

Modules: :mod:`.promql` (metric names an expression reads), :mod:`.queries` (shared PromQL
builders), :mod:`.panels` (grafana-foundation-sdk wrappers), :mod:`.lease_health` and
:mod:`.nixl_panels` (the "LeaseKit / KV lease health" board), :mod:`.rules` (recording and
alerting rules), :mod:`.checks` (metric-name checks), :mod:`.build` (``leasekit dashboards
build [--check]``; :func:`register` adds it to the CLI).
"""

from leasekit.dashboards.build import build, default_out_dir, register

__all__ = ["build", "default_out_dir", "register"]
