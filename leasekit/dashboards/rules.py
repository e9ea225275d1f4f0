"""Prometheus recording and alerting rules for the KV lease, generated to
``dashboards/leasekit-rules.yml`` (Prometheus rule-file format, ``promtool check rules``).

Recording rules follow Prometheus's ``level:metric:operations`` naming
(prometheus.io/docs/practices/rules/): ``instance:`` keeps ``job, instance``, ``instance_<label>:``
also that label, ``instance_tp_rank:`` also ``engine, tp_rank`` (one P worker), ``instance_remote_engine:``
also ``remote_engine_id`` (D side: the P engine D heartbeats). Every label is bounded (the metric
catalog names no D worker: :mod:`leasekit.telemetry.metrics`), so no rule joins on a peer's identity;
whether an expiring lease's D was alive is decided inside P (``peer_state``, the peer-returns counter:
:mod:`leasekit.telemetry.peers`) and the rules only aggregate it.
Aggregation rules are those of :mod:`leasekit.dashboards.queries`. Alerts: one per incident class, each with ``for``, a
``severity`` label and ``summary`` / ``description`` / ``runbook_url`` annotations; the runbook
sections are in ``docs/runbook.md`` under the lower-cased alert name. Their promtool unit tests
are ``dashboards/tests/*.yml``.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from leasekit.dashboards.queries import (
    config_gauge, per_instance_gauge, quantile, sum_new_or_increased, sum_rate,
)
from leasekit.lease.bounds import RECLAIM_LAG_FLOOR_S
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry import metrics as m

FILE_NAME = "leasekit-rules.yml"
DEFAULT_RUNBOOK_URL = "https://github.com/leasekit/leasekit/blob/main/docs/runbook.md"
DEFAULT_PINNED_BLOCKS_HIGH = 4096
"""Default LeasePinnedBlocksHigh threshold in KV blocks per P server: 64 Ki tokens at vLLM's
default block size 16, half of an 8192-block KV cache. Pinned blocks cannot serve new prefills;
set it to about half of your P engine's ``num_gpu_blocks`` (vLLM logs the KV cache size at
start; ``vllm:cache_config_info`` carries it) with ``leasekit dashboards build --pinned-blocks-high``."""

GAP_NEAR_EXTENSION = 0.8
"""LeaseHeartbeatGapNearExtension fires when heartbeat gap p99 > this fraction of ``E``: a gap
above ``E`` expires the lease (docs/lease-model.md: ``expiry = max(expiry, now + E)``)."""

ALERT_NAMES = (
    "LeaseExpiries", "LeaseExpiriesWhileDecodeHealthy", "LeaseLateCompletions", "LeaseReclaimLagOverBound",
    "LeasePinnedBlocksHigh", "LeaseHeartbeatGapNearExtension", "LeaseHeartbeatSendFailures",
    "LeaseReadsDiscarded",
)
"""Every alert of the rule file, in file order (the runbook has one section per name)."""

# recording rule names
GRANTS_RATE = "instance:leasekit_kv_lease_grants:rate5m"
EXPIRIES_RATE = "instance:leasekit_kv_lease_expiries:rate5m"
EXPIRY_RATIO = "instance:leasekit_kv_lease_expiry_ratio:rate5m"
EXPIRIES_BY_CAUSE = "instance_cause:leasekit_kv_lease_expiries:increase5m"
EXPIRIES_BY_RANK = "instance_tp_rank:leasekit_kv_lease_expiries:increase10m"  # by peer_state too
EXTENSIONS_BY_RANK = "instance_tp_rank:leasekit_kv_lease_extensions:rate2m"
PEER_RETURNS = "instance:leasekit_kv_lease_expired_peer_returns:increase10m"
LATE_UNSAFE = "instance:leasekit_kv_lease_late_completions_not_fail_closed:increase5m"
SEND_FAILURES_BY_REMOTE = "instance_remote_engine:leasekit_kv_lease_heartbeat_send_failures:increase5m"
DISCARDED_BY_OUTCOME = "instance_outcome:leasekit_kv_lease_reads_discarded:increase5m"
GAP_P50 = "instance:leasekit_kv_lease_heartbeat_gap_seconds:p50_5m"
GAP_P99 = "instance:leasekit_kv_lease_heartbeat_gap_seconds:p99_5m"
LAG_P99 = "instance:leasekit_kv_lease_reclaim_lag_seconds:p99_5m"
PINNED = "instance:leasekit_kv_lease_pinned_blocks:max_by_rank"
ACTIVE = "instance:leasekit_kv_leases_active:max_by_rank"
E_MAX = "instance:leasekit_kv_lease_extension_seconds:max"
H_MAX = "instance:leasekit_kv_lease_heartbeat_interval_seconds:max"

I = "job, instance"
IR = "job, instance, engine, tp_rank"  # P side: one worker (engine of the server, TP rank)
IE = "job, instance, remote_engine_id"  # D side: per P engine


@dataclass(frozen=True)
class RulesConfig:
    """Deployment choices baked into the rule file.

    Attributes:
        runbook_url: URL of ``docs/runbook.md`` (no anchor); alerts link ``<url>#<alertname
            lower-cased>``.
        pinned_blocks_high: LeasePinnedBlocksHigh threshold in KV blocks per P server (> 0).
    """

    runbook_url: str = DEFAULT_RUNBOOK_URL
    pinned_blocks_high: int = DEFAULT_PINNED_BLOCKS_HIGH

    def __post_init__(self) -> None:
        if self.pinned_blocks_high <= 0:
            raise ValueError(f"pinned_blocks_high must be > 0, got {self.pinned_blocks_high}")
        if not self.runbook_url or "#" in self.runbook_url:
            raise ValueError(f"runbook_url must be a URL without an anchor, got {self.runbook_url!r}")


def recording_rules() -> list[dict[str, str]]:
    """The recording rules (``{"record": name, "expr": promql}``), in evaluation order."""
    c = lambda spec: spec.sample_names[0]  # counter series name
    rules = [(f"instance:{spec.name}:rate5m", sum_rate(c(spec), I, "5m"))
             for spec in (m.GRANTS, m.EXTENSIONS, m.RELEASES, m.EXPIRIES, m.EXPIRED_PEER_RETURNS, m.ABORTS,
                          m.LATE_COMPLETIONS,
                          m.HEARTBEATS_SENT, m.HEARTBEAT_SEND_FAILURES)]
    rules += [
        (EXPIRY_RATIO, f"{EXPIRIES_RATE}\n/\n({GRANTS_RATE} > 0)"),
        (EXPIRIES_BY_CAUSE, sum_new_or_increased(c(m.EXPIRIES), f"{I}, cause", "5m")),
        (EXPIRIES_BY_RANK, sum_new_or_increased(c(m.EXPIRIES), IR + ", peer_state", "10m")),
        (EXTENSIONS_BY_RANK, sum_rate(c(m.EXTENSIONS), IR, "2m")),
        (PEER_RETURNS, sum_new_or_increased(c(m.EXPIRED_PEER_RETURNS), I, "10m")),
        (LATE_UNSAFE, sum_new_or_increased(c(m.LATE_COMPLETIONS), I, "5m", 'fail_closed!="true"')),
        (SEND_FAILURES_BY_REMOTE, sum_new_or_increased(c(m.HEARTBEAT_SEND_FAILURES), IE, "5m")),
        (DISCARDED_BY_OUTCOME, sum_new_or_increased(c(m.READS), f"{I}, outcome", "5m",
                                                    'outcome=~"reaped|timeout|ungated"')),
        (GAP_P50, quantile(0.5, m.HEARTBEAT_GAP.name + "_bucket", I, "5m")),
        (GAP_P99, quantile(0.99, m.HEARTBEAT_GAP.name + "_bucket", I, "5m")),
        (LAG_P99, quantile(0.99, m.RECLAIM_LAG.name + "_bucket", I, "5m")),
        (PINNED, per_instance_gauge(m.PINNED_BLOCKS.name)),
        (ACTIVE, per_instance_gauge(m.LEASES_ACTIVE.name)),
        (E_MAX, config_gauge(m.EXTENSION.name)),
        (H_MAX, config_gauge(m.HEARTBEAT_INTERVAL.name)),
    ]
    return [{"record": name, "expr": expr} for name, expr in rules]


def _alert(config: RulesConfig, name: str, expr: str, for_: str, severity: str, summary: str,
           description: str) -> dict[str, object]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description,
                            "runbook_url": f"{config.runbook_url}#{name.lower()}"}}


def expiries_while_decode_healthy() -> str:
    """The LeaseExpiriesWhileDecodeHealthy condition, per P server (``job, instance``): expiries in the
    last 10 minutes whose D was alive, in any of three ways (each a separate operand of ``or``):

    1. ``peer_state="heartbeating"``: P took a heartbeat from the lease's D agent less than 2 H before the
       reap (:mod:`leasekit.telemetry.peers`);
    2. silent expiries whose D agent was heard from again (the peer-returns counter): a stall;
    3. ``peer_state="unknown"`` expiries on a P rank that got no extension in 2 minutes while another rank
       of the same engine did: D heartbeats some of P's ranks and not this one (the per-rank
       recorder never heard of a D for those leases, so 1 cannot see it).
    """
    return (f"sum by ({I}) ({EXPIRIES_BY_RANK}{{peer_state=\"{ev.PEER_HEARTBEATING}\"}} > 0)\n"
            f"or\n{PEER_RETURNS} > 0\n"
            f"or\nsum by ({I}) (\n  {EXPIRIES_BY_RANK}{{peer_state=\"{ev.PEER_UNKNOWN}\"}} > 0\n"
            f"  and on ({IR}) ({EXTENSIONS_BY_RANK} == 0)\n"
            f"  and on ({I}, engine) (sum by ({I}, engine) ({EXTENSIONS_BY_RANK}) > 0)\n)")


def alerting_rules(config: RulesConfig) -> list[dict[str, object]]:
    """The alerting rules, in :data:`ALERT_NAMES` order (see docs/runbook.md for each)."""
    inst, engine = "{{ $labels.instance }}", "{{ $labels.remote_engine_id }}"
    return [
        _alert(config, "LeaseExpiries", f"{EXPIRIES_BY_CAUSE} > 0", "0m", "warning",
               f"P server {inst} reclaimed expired KV leases (cause {{{{ $labels.cause }}}})",
               f"P server {inst} expired {{{{ $value }}}} lease(s) with cause {{{{ $labels.cause }}}} in the last 5 "
               "minutes and reclaimed their KV blocks: D stopped heartbeating those requests (D died, was "
               "stalled longer than E - H, was cut off from P, or aborted them). The mechanism worked (blocks "
               "are free again); find out which D went silent and whether it is coming back."),
        _alert(config, "LeaseExpiriesWhileDecodeHealthy", expiries_while_decode_healthy(), "5m", "warning",
               f"Leases on {inst} expire while their D worker is alive",
               f"P server {inst} reclaimed leases in the last 10 minutes, for 5 minutes, whose D worker was alive: "
               "its NIXL agent still heartbeated other leases at the reap (peer_state=\"heartbeating\"), or went "
               "silent and was heard from again (a stall, not a death: leasekit_kv_lease_expired_peer_returns), or "
               "the lease's P TP rank got no heartbeat at all while other ranks of the same engine did. D stopped "
               "heartbeating those requests (client aborts on D do, benignly) or its heartbeats arrive later than "
               "E (stalls, long forward passes, lost notifications). D may read freed blocks. A dead or restarted "
               "D never fires this: its leases expire silent and a restarted D is a new agent."),
        _alert(config, "LeaseLateCompletions", f"{LATE_UNSAFE} > 0", "0m", "critical",
               f"Late read completions on {inst}",
               f"P server {inst} received read-completion notifications from D workers for "
               "leases that had already ended, in the last 5 minutes: D read KV blocks P may have freed and "
               "reused, so the tokens it generated may be wrong (the fail-closed gap: docs/telemetry.md, kv_lease_late_read). "
               "Late reads of a D that speaks the fail-closed protocol (fail_closed=\"true\") are discarded by D "
               "and do not fire this; they show as LeaseReadsDiscarded on D."),
        _alert(config, "LeaseReclaimLagOverBound",
               f"{LAG_P99}\n> on ({I})\nclamp_min({H_MAX}, {RECLAIM_LAG_FLOOR_S:g})", "1m", "warning",
               f"Reclaim lag p99 {{{{ $value | humanizeDuration }}}} on {inst} is over the bound",
               f"P server {inst} frees expired leases' KV blocks {{{{ $value | humanizeDuration }}}} after their "
               f"deadline (p99 over 5 minutes), more than the tick allowance max(H, {RECLAIM_LAG_FLOOR_S:g} s). "
               "The bound: reap <= deadline + tick. P's engine loop is stalled or slow, so blocks stay "
               "pinned past their lease and heartbeats are handled late."),
        _alert(config, "LeasePinnedBlocksHigh", f"{PINNED} > {config.pinned_blocks_high}", "10m", "warning",
               f"{{{{ $value }}}} KV blocks pinned under leases on {inst}",
               f"P server {inst} has kept more than {config.pinned_blocks_high} KV blocks pinned under open leases "
               "for 10 minutes (sum over engines of the max over TP ranks). Pinned blocks cannot serve new "
               "prefills. D reads slowly or not at all, or a long D queue keeps leases extended."),
        _alert(config, "LeaseHeartbeatGapNearExtension",
               f"{GAP_P99}\n> on ({I})\n{GAP_NEAR_EXTENSION:g} * {E_MAX}", "5m", "warning",
               f"Heartbeat gap p99 {{{{ $value | humanizeDuration }}}} on {inst} is near the extension E",
               f"Heartbeats reach P server {inst} with a p99 gap of {{{{ $value | humanizeDuration }}}} over 5 "
               f"minutes, above {GAP_NEAR_EXTENSION:g} * E. A gap above E expires the lease while D is healthy. "
               "D's forward passes or P's steps are long, or heartbeats are lost."),
        _alert(config, "LeaseHeartbeatSendFailures", f"{SEND_FAILURES_BY_REMOTE} > 0", "5m", "warning",
               f"D server {inst} fails to send heartbeats to P engine {engine}",
               f"D server {inst} has failed to send heartbeat notifications to P engine {engine} for 5 minutes "
               "(NIXL send_notif raised). One lost heartbeat is within the loss budget; repeated losses expire "
               "leases of requests D still holds."),
        _alert(config, "LeaseReadsDiscarded", f"{DISCARDED_BY_OUTCOME} > 0", "0m", "warning",
               f"D server {inst} discarded late KV reads ({{{{ $labels.outcome }}}})",
               f"D server {inst} discarded {{{{ $value }}}} read(s) of P's KV blocks in the last 5 minutes with "
               "outcome {{ $labels.outcome }} (reaped: P had already ended the lease; timeout: no verdict from P "
               "in time; ungated: the read could not be checked). No wrong tokens were served: vLLM's kv_load_failure_policy recomputed or failed those "
               "requests. Leases are expiring under D's queued or stalled requests (docs/fail-closed.md)."),
    ]


def rules_document(config: RulesConfig) -> dict[str, object]:
    """The rule file as data: ``{"groups": [recording group, alerting group]}``."""
    return {"groups": [
        {"name": "leasekit-kv-lease-recording", "rules": recording_rules()},
        {"name": "leasekit-kv-lease-alerts", "rules": alerting_rules(config)},
    ]}


class _Dumper(yaml.SafeDumper):
    pass


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)

HEADER = ("# Generated by `leasekit dashboards build` from leasekit/dashboards/rules.py; do not edit.\n"
          "# Check: promtool check rules dashboards/leasekit-rules.yml; "
          "promtool test rules dashboards/tests/*.yml\n")


def render_yaml(document: dict[str, object]) -> str:
    """``document`` as deterministic YAML (key order as built, multi-line strings as ``|``
    blocks) after :data:`HEADER`."""
    return HEADER + yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                              width=1000, allow_unicode=False)
