"""PromQL builders shared by the dashboard and the rules, so both aggregate the same way.

Every function returns PromQL text. ``matchers`` is the label-matcher list without braces; the
dashboard passes :data:`DASHBOARD_FILTER` so every panel honours the ``$job``/``$instance``
variables, the rules pass ``""`` (they evaluate over every scraped server).

Aggregation rules (from :mod:`leasekit.telemetry.metrics` help texts, docs/lease-model.md invariant 9):
gauges of open leases and pinned blocks are reported by every P TP rank for the same requests
(each rank pins its shard of the same blocks), so a server's value is the **sum over engines of
the max over ranks** (:func:`per_instance_gauge`); summing ranks would multiply by TP size.
Counters count per request per TP rank; rates are summed as exported and labelled so.
"""

from __future__ import annotations

DASHBOARD_FILTER = 'job=~"$job", instance=~"$instance"'
"""Label matchers every dashboard query carries (Grafana variables ``job``, ``instance``)."""

INSTANCE = "job, instance"
"""The labels that identify one scraped vLLM server (Prometheus adds ``job`` and ``instance``)."""


def selector(name: str, matchers: str = "", extra: str = "") -> str:
    """``name{matchers, extra}``, or the bare ``name`` when both are empty."""
    parts = ", ".join(p for p in (matchers, extra) if p)
    return f"{name}{{{parts}}}" if parts else name


def sum_rate(name: str, by: str, window: str, matchers: str = "", extra: str = "") -> str:
    """``sum by (by) (rate(name{...}[window]))``: per-second rate of a counter series
    (``name`` must be the scraped ``*_total`` / ``*_sum`` / ``*_count`` name)."""
    return f"sum by ({by}) (rate({selector(name, matchers, extra)}[{window}]))"


def sum_increase(name: str, by: str, window: str, matchers: str = "", extra: str = "") -> str:
    """``sum by (by) (increase(name{...}[window]))``: counter increase over ``window``."""
    return f"sum by ({by}) (increase({selector(name, matchers, extra)}[{window}]))"


def sum_new_or_increased(name: str, by: str, window: str, matchers: str = "") -> str:
    """Events of a rare-event counter in ``window``, counting a series that first appeared in
    the window at its first value.

    prometheus-client creates a labelled child (e.g. a new ``remote_agent``) on its first
    increment, so the series is born at 1 and ``increase()`` (which needs two samples) misses
    that first event. The second operand adds series absent ``window`` ago, at their current
    value (all of it happened since they appeared). Series that existed before and increased
    come from the first operand. A lower bound, exact for series born in the window that did
    not increase again; use for ``> 0`` conditions.
    """
    sel = selector(name, matchers)
    return (f"sum by ({by}) (\n  (increase({sel}[{window}]) > 0)\n"
            f"  or\n  ({sel} unless {sel} offset {window})\n)")


def quantile(q: float, bucket: str, by: str, window: str, matchers: str = "") -> str:
    """``histogram_quantile(q, sum by (by, le) (rate(bucket{...}[window])))``; ``bucket`` is the
    ``*_bucket`` series name; the result keeps the ``by`` labels. NaN (no point on a graph,
    never true in a comparison) when nothing was observed in the window."""
    return f"histogram_quantile({q}, {sum_rate(bucket, by + ', le', window, matchers)})"


def per_instance_gauge(name: str, by: str = INSTANCE, matchers: str = "") -> str:
    """A per-TP-rank lease gauge for a whole server: sum over engines of the max over ranks
    (module docstring); keeps the ``by`` labels."""
    return f"sum by ({by}) (max by ({by}, engine) ({selector(name, matchers)}))"


def config_gauge(name: str, by: str = INSTANCE, matchers: str = "") -> str:
    """A configuration gauge (L, H, E) per server: ``max by (by)`` over engines, ranks and
    ``kv_role`` (all carry the same value in one server)."""
    return f"max by ({by}) ({selector(name, matchers)})"
