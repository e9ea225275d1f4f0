"""The dashboard row of vLLM's own NIXL metrics (``vllm:nixl_*``, vllm 0.32.0
``nixl/stats.py: NixlPromMetrics``), next to LeaseKit's lease metrics so one board answers an
incident.

Counting (read from vllm 0.32.0 ``kv_connector/utils.py``: the scheduler aggregates every
worker's ``NixlKVConnectorStats``, so each worker's record is counted): ``num_kv_expired_reqs``
counts per request per P TP rank, like ``leasekit_kv_lease_expiries_total``;
``num_notifications_after_expiry`` per notification (one per consumer rank) per P rank, like
``leasekit_kv_lease_late_completions_total``; ``num_failed_transfers`` already includes failed
handshakes and failed notifications, which ``num_failed_notifications`` counts again. vLLM's
metrics carry no ``tp_rank`` label.
"""

from __future__ import annotations

from grafana_foundation_sdk.cog.builder import Builder

from leasekit.dashboards.panels import Query, timeseries
from leasekit.dashboards.queries import DASHBOARD_FILTER as F
from leasekit.dashboards.queries import quantile, sum_rate
from leasekit.telemetry import metrics as m

W = "$__rate_interval"
I = "job, instance"
XFER = "vllm:nixl_xfer_time_seconds"
POST = "vllm:nixl_post_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"
FAILED_XFERS = "vllm:nixl_num_failed_transfers_total"
FAILED_NOTIFS = "vllm:nixl_num_failed_notifications_total"
EXPIRED_REQS = "vllm:nixl_num_kv_expired_reqs_total"
NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"


def panels() -> list[Builder]:
    """The NIXL row's panels (time series, range queries)."""
    return [
        timeseries("NIXL transfer time p50 / p99 (D reads)",
                   "vllm:nixl_xfer_time_seconds: duration of each NIXL KV read; post time is the time to post it.",
                   [Query(quantile(0.5, XFER + "_bucket", I, W, F), "{{instance}} xfer p50"),
                    Query(quantile(0.99, XFER + "_bucket", I, W, F), "{{instance}} xfer p99"),
                    Query(quantile(0.99, POST + "_bucket", I, W, F), "{{instance}} post p99")], "s"),
        timeseries("NIXL bytes transferred",
                   "vllm:nixl_bytes_transferred: bytes per second read over NIXL, and the mean bytes per transfer.",
                   [Query(sum_rate(BYTES + "_sum", I, W, F), "{{instance}} bytes/s"),
                    Query(f"{sum_rate(BYTES + '_sum', I, W, F)}\n/\n({sum_rate(BYTES + '_count', I, W, F)} > 0)",
                          "{{instance}} bytes per transfer")], "Bps"),
        timeseries("NIXL failed transfers / failed notifications",
                   "vllm:nixl_num_failed_transfers includes failed handshakes and failed notifications; "
                   "vllm:nixl_num_failed_notifications counts the latter again. Lease expiries are never "
                   "counted here (docs/lease-model.md invariant 9).",
                   [Query(sum_rate(FAILED_XFERS, I, W, F), "{{instance}} failed transfers"),
                    Query(sum_rate(FAILED_NOTIFS, I, W, F), "{{instance}} failed notifications")], "ops"),
        timeseries("Expired requests: vLLM vs LeaseKit",
                   "vllm:nixl_num_kv_expired_reqs and leasekit_kv_lease_expiries both count per request per P "
                   "TP rank; the two lines should match. A gap means a reap path one of them does not see.",
                   [Query(sum_rate(EXPIRED_REQS, I, W, F), "{{instance}} vllm:nixl_num_kv_expired_reqs"),
                    Query(sum_rate(m.EXPIRIES.sample_names[0], I, W, F), "{{instance}} leasekit expiries")],
                   "ops", width=12),
        timeseries("Notifications after expiry: vLLM vs LeaseKit late completions",
                   "vllm:nixl_num_notifications_after_expiry and leasekit_kv_lease_late_completions both count "
                   "per notification (one per consumer rank) per P rank: reads that finished after P freed the "
                   "blocks, whose tokens may come from reused blocks.",
                   [Query(sum_rate(NOTIFS_AFTER_EXPIRY, I, W, F),
                          "{{instance}} vllm:nixl_num_notifications_after_expiry"),
                    Query(sum_rate(m.LATE_COMPLETIONS.sample_names[0], I, W, F), "{{instance}} leasekit late completions")],
                   "ops", width=12),
    ]
