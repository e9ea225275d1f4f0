"""The "LeaseKit / KV lease health" Grafana dashboard: one board that answers a lease incident.

Rows: leases now (P) - lease lifecycle - heartbeats and bounds - remote peers - per TP rank
- vLLM's own NIXL transfer panels (:mod:`leasekit.dashboards.nixl_panels`). Every query reads
only metrics of :mod:`leasekit.telemetry.metrics` (names taken from the catalog's specs) and
filters ``job=~"$job", instance=~"$instance"``; no panel names a D worker (the catalog's labels are
bounded): P shows what it knew of an expiring lease's D (``peer_state``) and D stalls it saw end (peer
returns), D shows heartbeats by P engine id. Aggregation rules are in
:mod:`leasekit.dashboards.queries`. The bounds shown next to measurements are those of docs/lease-model.md:
a heartbeat gap above ``E`` expires the lease; reclaim lag (reap - deadline) must stay within the
tick allowance, drawn as ``max(H, 0.5 s)`` (see :data:`leasekit.dashboards.rules.RECLAIM_LAG_FLOOR_S`).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import dashboard as dashboard_m

from leasekit.dashboards import nixl_panels
from leasekit.dashboards.panels import Query, alerts_annotation, datasource_variable, query_variable, stat, timeseries
from leasekit.dashboards.queries import DASHBOARD_FILTER as F
from leasekit.dashboards.queries import config_gauge, per_instance_gauge, quantile, sum_increase, sum_rate
from leasekit.dashboards.rules import ALERT_NAMES, RECLAIM_LAG_FLOOR_S
from leasekit.telemetry import metrics as m

UID = "leasekit-lease-health"
TITLE = "LeaseKit / KV lease health"
FILE_NAME = "lease-health.json"
W = "$__rate_interval"
I = "job, instance"
PER_REQ_RANK = "Counts per request per P TP rank (a request served by 2 ranks counts 2)."


def _c(spec: m.MetricSpec) -> str:
    return spec.sample_names[0]  # counter: *_total


def _bucket(spec: m.MetricSpec) -> str:
    return spec.name + "_bucket"


def _leases_now() -> list[Builder]:
    note = " Per server: sum over engines of the max over TP ranks (every rank holds the same leases)."
    return [
        timeseries("Active leases per P instance", m.LEASES_ACTIVE.help + note,
                   [Query(per_instance_gauge(m.LEASES_ACTIVE.name, I, F), "{{instance}}")], "short"),
        timeseries("Pinned KV blocks per P instance", m.PINNED_BLOCKS.help + note,
                   [Query(per_instance_gauge(m.PINNED_BLOCKS.name, I, F), "{{instance}}")], "short"),
        timeseries("Leases expiring soon (heartbeat overdue)", m.EXPIRING_SOON.help + note,
                   [Query(per_instance_gauge(m.EXPIRING_SOON.name, I, F), "{{instance}}")], "short"),
        timeseries("Expiry ratio (expiries / grants)",
                   "Share of granted leases that expired instead of being read by D. Both count per request "
                   "per TP rank, so the ratio is per request. No point while nothing is granted.",
                   [Query(f"{sum_rate(_c(m.EXPIRIES), I, W, F)}\n/\n({sum_rate(_c(m.GRANTS), I, W, F)} > 0)",
                          "{{instance}}")], "percentunit", width=12),
        stat("Lease config per server: L, H, E",
             "kv_lease_duration L, heartbeat interval H = L // 6 and extension E = L * 2 // 3 as each server "
             "reports them (P and D must agree; `leasekit bounds --lease-duration L` prints the bounds).",
             [Query(config_gauge(s.name, I + ", kv_role", F), "{{instance}} {{kv_role}} " + sym)
              for s, sym in ((m.DURATION, "L"), (m.HEARTBEAT_INTERVAL, "H"), (m.EXTENSION, "E"))],
             "s", width=12),
    ]


def _lifecycle() -> list[Builder]:
    events = ((m.GRANTS, "grant"), (m.EXTENSIONS, "extend"), (m.EXPIRIES, "expire"),
              (m.RELEASES, "release"), (m.ABORTS, "abort"))
    return [
        timeseries("Grant / extend / expire / release / abort rate",
                   "Lease events per second per P server. " + PER_REQ_RANK
                   + " Extensions count one per request named by each delivered heartbeat.",
                   [Query(sum_rate(_c(s), I, W, F), "{{instance}} " + word) for s, word in events], "ops", width=12),
        timeseries("Expiries by cause", m.EXPIRIES.help + " no_heartbeat: no heartbeat was ever delivered; "
                   "heartbeat_lapsed: heartbeats stopped for longer than E.",
                   [Query(sum_rate(_c(m.EXPIRIES), I + ", cause", W, F), "{{instance}} {{cause}}")],
                   "ops", width=12, stacked=True),
        timeseries("Late completions (reads that may have used freed blocks)",
                   m.LATE_COMPLETIONS.help + " Any value above 0 with fail_closed=false fires LeaseLateCompletions.",
                   [Query(sum_increase(_c(m.LATE_COMPLETIONS), I + ", tp_rank, fail_closed", W, F),
                          "{{instance}} rank {{tp_rank}} (fail_closed={{fail_closed}})")], "short", width=12),
        timeseries("Lease hold time p50 / p99 by outcome vs max hold", m.HOLD.help + " " + m.MAX_HOLD.help,
                   [Query(quantile(q, _bucket(m.HOLD), I + ", outcome", W, F), f"{{{{instance}}}} {{{{outcome}}}} p{p}")
                    for q, p in ((0.5, 50), (0.99, 99))]
                   + [Query(config_gauge(m.MAX_HOLD.name, I, F), "{{instance}} max hold (cap)")], "s", width=12),
        timeseries("Reads by gate outcome (D)", m.READS.help + " reaped/timeout: a late read caught and discarded "
                   "(fail closed); unprotected: the P is stock, reads are not checked; pushed: push mode, P wrote the blocks. "
                   "Verdicts P failed to send: "
                   + m.VERDICT_SEND_FAILURES.help,
                   [Query(sum_rate(_c(m.READS), I + ", outcome", W, F), "{{instance}} {{outcome}}"),
                    Query(sum_rate(_c(m.VERDICT_SEND_FAILURES), I, W, F), "{{instance}} verdict send failures (P)")],
                   "ops", width=12, stacked=True),
        timeseries("Read verdict wait p50 / p99 (D)", m.READ_VERDICT_WAIT.help,
                   [Query(quantile(q, _bucket(m.READ_VERDICT_WAIT), I, W, F), f"{{{{instance}}}} p{p}")
                    for q, p in ((0.5, 50), (0.99, 99))], "s", width=12),
        timeseries("Verified reads by proof (D)", m.READ_PROOFS_METRIC.help,
                   [Query(sum_rate(_c(m.READ_PROOFS_METRIC), I + ", proof", W, F), "{{instance}} {{proof}}")],
                   "ops", width=12, stacked=True),
        timeseries("Pledge hold p50 / p99 (P)", m.PLEDGE_HOLD.help,
                   [Query(quantile(q, _bucket(m.PLEDGE_HOLD), I, W, F), f"{{{{instance}}}} p{p}")
                    for q, p in ((0.5, 50), (0.99, 99))], "s", width=12),
        timeseries("Push mode: WRITEs by outcome (P), late WRITEs and withheld registrations (D)",
                   m.PUSH_WRITES_METRIC.help + " D: " + m.PUSH_LATE_WRITES.help + " D: " + m.PUSH_WITHHELD.help,
                   [Query(sum_rate(_c(m.PUSH_WRITES_METRIC), I + ", outcome", W, F), "{{instance}} {{outcome}}"),
                    Query(sum_rate(_c(m.PUSH_LATE_WRITES), I, W, F), "{{instance}} late WRITE notifications (D)"),
                    Query(sum_rate(_c(m.PUSH_WITHHELD), I, W, F), "{{instance}} registrations withheld (D)")],
                   "ops", width=12),
    ]


def _heartbeats_and_bounds() -> list[Builder]:
    gap, lag = _bucket(m.HEARTBEAT_GAP), _bucket(m.RECLAIM_LAG)
    return [
        timeseries("Heartbeat gap p50 / p99 vs extension E",
                   m.HEARTBEAT_GAP.help + " LeaseHeartbeatGapNearExtension fires when p99 > 0.8 * E.",
                   [Query(quantile(0.5, gap, I, W, F), "{{instance}} gap p50"),
                    Query(quantile(0.99, gap, I, W, F), "{{instance}} gap p99"),
                    Query(config_gauge(m.EXTENSION.name, I, F), "{{instance}} E (a gap above E expires the lease)"),
                    Query(f"0.8 * {config_gauge(m.EXTENSION.name, I, F)}", "{{instance}} 0.8 * E (alert)")],
                   "s", width=12),
        timeseries("Reclaim lag p99 vs bound (tick allowance)",
                   m.RECLAIM_LAG.help + " bound (docs/lease-model.md): reap <= deadline + tick, i.e. lag <= tick. P's tick is "
                   f"not exported; the drawn bound is max(H, {RECLAIM_LAG_FLOOR_S:g} s), the threshold of "
                   "LeaseReclaimLagOverBound.",
                   [Query(quantile(0.99, lag, I, W, F), "{{instance}} reclaim lag p99"),
                    Query(f"clamp_min({config_gauge(m.HEARTBEAT_INTERVAL.name, I, F)}, {RECLAIM_LAG_FLOOR_S:g})",
                          "{{instance}} bound max(H, " + f"{RECLAIM_LAG_FLOOR_S:g}" + " s)")], "s", width=12),
        timeseries("Heartbeat notifications sent / send failures (D)",
                   m.HEARTBEATS_SENT.help + " Failures: " + m.HEARTBEAT_SEND_FAILURES.help,
                   [Query(sum_rate(_c(m.HEARTBEATS_SENT), I, W, F), "{{instance}} sent"),
                    Query(sum_rate(_c(m.HEARTBEAT_SEND_FAILURES), I, W, F), "{{instance}} failed")], "ops", width=12),
        timeseries("Heartbeats delivered vs sent",
                   "Extensions on P (per request per P rank) next to heartbeat notifications D sent (per "
                   "notification per P rank, naming all of one P engine's requests): extensions stop while "
                   "notifications continue when P drops or cannot match them.",
                   [Query(sum_rate(_c(m.EXTENSIONS), I, W, F), "{{instance}} extensions (P)"),
                    Query(sum_rate(_c(m.HEARTBEATS_SENT), I, W, F), "{{instance}} notifications sent (D)")],
                   "ops", width=12),
    ]


def _remote_peers() -> list[Builder]:
    engine = I + ", remote_engine_id"
    return [
        timeseries("Expiries by D state at the reap (P)", m.EXPIRIES.help + " heartbeating: the D was alive "
                   "(fires LeaseExpiriesWhileDecodeHealthy); silent: dead, stalled or cut off. Returns: "
                   + m.EXPIRED_PEER_RETURNS.help,
                   [Query(sum_rate(_c(m.EXPIRIES), I + ", peer_state", W, F), "{{instance}} D {{peer_state}}"),
                    Query(sum_rate(_c(m.EXPIRED_PEER_RETURNS), I, W, F), "{{instance}} silent D came back")],
                   "ops", stacked=True),
        timeseries("Extensions by TP rank (P)", m.EXTENSIONS.help + " No D worker is named (agent names are "
                   "claims, and new at every D restart). A rank at 0 while the other ranks of its engine "
                   "are not: D heartbeats only some of P's ranks, and this rank's leases expire.",
                   [Query(sum_rate(_c(m.EXTENSIONS), I + ", engine, tp_rank", W, F),
                          "{{instance}} engine {{engine}} rank {{tp_rank}}")], "ops"),
        timeseries("Heartbeats sent / failed by P engine (D)",
                   "On D, remote_engine_id is the P engine the heartbeats go to. " + m.HEARTBEATS_SENT.help,
                   [Query(sum_rate(_c(m.HEARTBEATS_SENT), engine, W, F), "{{instance}} -> {{remote_engine_id}} sent"),
                    Query(sum_rate(_c(m.HEARTBEAT_SEND_FAILURES), engine, W, F),
                          "{{instance}} -> {{remote_engine_id}} failed")], "ops"),
        timeseries("Notifications dropped by reason (P)", m.NOTIFICATIONS_DROPPED.help + " Malformed reasons "
                   "(not_utf8, no_colon, bad_count, ...) would crash stock P's engine; foreign_* are heartbeats or "
                   "completions from an agent a plain lease is not bound to, unproven_* messages without a valid proof for a "
                   "lease bound by proof, or hellos that prove no lease (a misrouted or forging peer).",
                   [Query(sum_rate(_c(m.NOTIFICATIONS_DROPPED), I + ", reason", W, F), "{{instance}} {{reason}}")],
                   "ops", width=12, stacked=True),
        timeseries("Lease bindings by proof / unknown heartbeat ids (P)", m.BINDINGS.help + " Unknown ids: "
                   + m.HEARTBEAT_UNKNOWN_IDS.help,
                   [Query(sum_rate(_c(m.BINDINGS), I + ", proof", W, F), "{{instance}} {{proof}}"),
                    Query(sum_rate(_c(m.HEARTBEAT_UNKNOWN_IDS), I, W, F), "{{instance}} unknown heartbeat ids")],
                   "ops", width=12),
        timeseries("Spans not exported by reason", m.SPANS_DROPPED.help + " Lease evidence (spans) is missing for "
                   "these; metrics and logs still carry every transition.",
                   [Query(sum_rate(_c(m.SPANS_DROPPED), I + ", reason", W, F), "{{instance}} {{reason}}")],
                   "ops", width=12, stacked=True),
        timeseries("Handshake listener up (P)", m.HANDSHAKE_LISTENER_UP.help + " Per server: the min over "
                   "engines (one engine down is down). Stock vLLM 0.32's listener dies on one malformed request.",
                   [Query(f"min by ({I}) ({m.HANDSHAKE_LISTENER_UP.name}{{{F}}})", "{{instance}} up")],
                   "short", width=12),
        timeseries("Handshake requests / bad requests by reason (P)",
                   m.HANDSHAKE_REQUESTS.help + " Bad: " + m.HANDSHAKE_BAD_REQUESTS.help,
                   [Query(sum_rate(_c(m.HANDSHAKE_REQUESTS), I, W, F), "{{instance}} answered"),
                    Query(sum_rate(_c(m.HANDSHAKE_BAD_REQUESTS), I + ", reason", W, F), "{{instance}} bad {{reason}}")],
                   "ops", width=12),
    ]


def _per_rank() -> list[Builder]:
    by = I + ", tp_rank"
    return [
        timeseries("Pinned KV blocks by TP rank", m.PINNED_BLOCKS.help + " Ranks of one server should agree; "
                   "a rank that stays high leaks or missed completions.",
                   [Query(f"sum by ({by}) ({m.PINNED_BLOCKS.name}{{{F}}})", "{{instance}} rank {{tp_rank}}")], "short"),
        timeseries("Active leases / expiring soon by TP rank", m.LEASES_ACTIVE.help,
                   [Query(f"sum by ({by}) ({m.LEASES_ACTIVE.name}{{{F}}})", "{{instance}} rank {{tp_rank}} active"),
                    Query(f"sum by ({by}) ({m.EXPIRING_SOON.name}{{{F}}})",
                          "{{instance}} rank {{tp_rank}} expiring soon")], "short"),
        timeseries("Grants / expiries / late completions by TP rank", PER_REQ_RANK,
                   [Query(sum_rate(_c(s), by, W, F), "{{instance}} rank {{tp_rank}} " + word)
                    for s, word in ((m.GRANTS, "grant"), (m.EXPIRIES, "expire"), (m.LATE_COMPLETIONS, "late"))], "ops"),
        timeseries("Heartbeat gap p99 by TP rank", m.HEARTBEAT_GAP.help,
                   [Query(quantile(0.99, _bucket(m.HEARTBEAT_GAP), by, W, F), "{{instance}} rank {{tp_rank}} p99")],
                   "s", width=12),
        timeseries("Reclaim lag p99 by TP rank", m.RECLAIM_LAG.help,
                   [Query(quantile(0.99, _bucket(m.RECLAIM_LAG), by, W, F), "{{instance}} rank {{tp_rank}} p99")],
                   "s", width=12),
    ]


def dashboard(runbook_url: str) -> dashboard_b.Dashboard:
    """The dashboard builder; ``runbook_url`` (the runbook page, no anchor) becomes a dashboard
    link. Panel ids are assigned in order, from 1."""
    board = (dashboard_b.Dashboard(TITLE).uid(UID).tags(["leasekit", "vllm", "kv-lease", "nixl"])
             .description("Generated by `leasekit dashboards build` from leasekit/dashboards/lease_health.py; "
                          "edit the Python, not the JSON.")
             .time("now-1h", "now").refresh("30s").timezone("browser").editable()
             .tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
             .link(dashboard_b.DashboardLink("LeaseKit runbook").type(dashboard_m.DashboardLinkType.LINK)
                   .url(runbook_url).target_blank(True).icon("doc"))
             .with_variable(datasource_variable())
             .with_variable(query_variable("job", "Job", f"label_values({m.DURATION.name}, job)"))
             .with_variable(query_variable("instance", "Instance",
                                           f'label_values({m.DURATION.name}{{job=~"$job"}}, instance)'))
             .annotation(alerts_annotation(
                 f'ALERTS{{alertname=~"{"|".join(ALERT_NAMES)}", alertstate="firing", {F}}}')))
    sections = (("Leases now (P)", _leases_now()), ("Lease lifecycle (P)", _lifecycle()),
                ("Heartbeats and bounds", _heartbeats_and_bounds()), ("Remote peers", _remote_peers()),
                ("Per TP rank", _per_rank()), ("vLLM NIXL transfers (vllm:nixl_*)", nixl_panels.panels()))
    next_id = 1
    for title, panels in sections:
        board = board.with_row(dashboard_b.Row(title).collapsed(False).id(next_id))
        next_id += 1
        for panel in panels:
            board = board.with_panel(panel.id(next_id))
            next_id += 1
    return board
