"""Per-server lease health from scraped samples: totals, breakdowns, per-rank rows and a verdict.

Pure functions over :class:`~leasekit.runbook.promscrape.Sample` lists (no I/O). Metric names,
kinds and labels come from the catalog :mod:`leasekit.telemetry.metrics`; totals sum over every
label (``model_name``, ``engine``, ``tp_rank``, ``cause``, ``peer_state``, ...). No metric names a D worker
(the catalog's labels are bounded: :mod:`leasekit.telemetry.metrics`); on D, heartbeat failures are broken
down by the P engine id.

Verdict rules (first match wins; sources in brackets):

- ``NO_LEASE_METRICS``: the server exports none of the catalog's ``leasekit_*`` series.
- ``CRITICAL``: late completions > 0 from D agents that do not speak the fail-closed protocol
  (``leasekit_kv_lease_late_completions{fail_closed!="true"}``), or vLLM's
  ``vllm:nixl_num_notifications_after_expiry`` above LeaseKit's fail-closed late completions (a stock
  P counts every late read there): D read blocks of a lease P had already ended, so the read may have
  used freed or reused KV blocks [docs/lease-model.md invariant 5; vllm 0.32.0 ``nixl/stats.py`` "the reader
  may have consumed KV blocks that were already reused"].
- ``DEGRADED``: late completions from fail-closed D agents only: P told D to discard those reads
  (docs/fail-closed.md), so they cost a recompute, not wrong tokens.
- ``CRITICAL``: ``leasekit_kv_handshake_listener_up`` is 0 for any engine: P's NIXL side-channel
  handshake listener thread is not running, so no new D engine can connect, although ``/health``
  stays 200 [vllm 0.32.0 ``nixl/base_scheduler.py: _nixl_handshake_listener``: the stock thread dies
  on one malformed request; :mod:`leasekit.vllm.prefill.listener`]. The gauge is updated at P's engine
  steps, so an idle P shows its last report.
- ``DEGRADED``: expiries > 0, vLLM's ``vllm:nixl_num_kv_expired_reqs`` > 0, leases expiring soon
  (a heartbeat overdue) > 0, heartbeat send failures > 0, or malformed handshake requests refused
  > 0 (``leasekit_kv_handshake_bad_requests``: a D with a mismatched parallel config, or a foreign
  client, is hitting P's side channel; that peer could not connect) [metrics catalog help texts].
- ``OK`` otherwise.

Counters are read as given: totals since the server started for one scrape, increases over the
interval for ``--interval`` (see :func:`leasekit.runbook.promscrape.counter_deltas`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from leasekit.lease.config import LeaseConfigError, LeaseTiming, lint_timing_findings
from leasekit.runbook.promscrape import Sample
from leasekit.telemetry import metrics as m

OK, DEGRADED, CRITICAL = "OK", "DEGRADED", "CRITICAL"
UNREACHABLE, NO_LEASE_METRICS, UNKNOWN = "UNREACHABLE", "NO_LEASE_METRICS", "UNKNOWN"
VERDICTS = (OK, DEGRADED, CRITICAL, UNREACHABLE, NO_LEASE_METRICS, UNKNOWN)

GAUGES: dict[str, str] = {
    "leases_active": m.LEASES_ACTIVE.name,
    "pinned_blocks": m.PINNED_BLOCKS.name,
    "expiring_soon": m.EXPIRING_SOON.name,
}
"""Report key -> gauge sample name (per TP rank; summed for totals)."""

COUNTERS: dict[str, str] = {
    "grants": m.GRANTS.sample_names[0],
    "extensions": m.EXTENSIONS.sample_names[0],
    "releases": m.RELEASES.sample_names[0],
    "expiries": m.EXPIRIES.sample_names[0],
    "expired_peer_returns": m.EXPIRED_PEER_RETURNS.sample_names[0],
    "aborts": m.ABORTS.sample_names[0],
    "late_completions": m.LATE_COMPLETIONS.sample_names[0],
    "heartbeats_sent": m.HEARTBEATS_SENT.sample_names[0],
    "heartbeat_send_failures": m.HEARTBEAT_SEND_FAILURES.sample_names[0],
    "reads": m.READS.sample_names[0],
}
"""Report key -> leasekit counter sample name (``_total``)."""

VLLM_COUNTERS: dict[str, str] = {
    name: name + "_total"
    for name in ("vllm:nixl_num_kv_expired_reqs", "vllm:nixl_num_notifications_after_expiry",
                 "vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_notifications")
}
"""vLLM's own NIXL counters reported next to ours (family name -> sample name)."""

LISTENER_COUNTERS: dict[str, str] = {
    "handshake_requests": m.HANDSHAKE_REQUESTS.sample_names[0],
    "handshake_bad_requests": m.HANDSHAKE_BAD_REQUESTS.sample_names[0],
}
"""Report key -> counter sample name of P's handshake listener (per server engine, not per TP rank)."""

def remote_label(spec: m.MetricSpec) -> str:
    """The label naming the remote peer on ``spec`` (from the catalog: ``remote_engine_id`` on D-side
    heartbeat metrics; P-side metrics name no peer).

    Raises:
        ValueError: the metric has no ``remote_*`` label.
    """
    for label in spec.labels:
        if label.startswith("remote_"):
            return label
    raise ValueError(f"{spec.name} has no remote_* label in the metric catalog")


BREAKDOWNS: dict[str, tuple[str, str]] = {
    "expiries_by_cause": (COUNTERS["expiries"], "cause"),
    "reads_by_outcome": (COUNTERS["reads"], "outcome"),
    "expiries_by_peer_state": (COUNTERS["expiries"], "peer_state"),
    "late_completions_by_fail_closed": (COUNTERS["late_completions"], "fail_closed"),
    "late_completions_by_tp_rank": (COUNTERS["late_completions"], "tp_rank"),
    f"heartbeat_send_failures_by_{remote_label(m.HEARTBEAT_SEND_FAILURES)}":
        (COUNTERS["heartbeat_send_failures"], remote_label(m.HEARTBEAT_SEND_FAILURES)),
}
"""Report key -> (counter sample name, label it is broken down by). Keys name the catalog's label,
e.g. ``expiries_by_peer_state``, ``heartbeat_send_failures_by_remote_engine_id``."""

_HB_FAIL_BY_REMOTE = f"heartbeat_send_failures_by_{remote_label(m.HEARTBEAT_SEND_FAILURES)}"


_BAD_HANDSHAKES_BY_REASON = "handshake_bad_requests_by_reason"


def _listener(series: dict[str, list[Sample]]) -> dict[str, Any]:
    """``{"up": 1|0|None, "down_engines": [engine, ...]}`` from ``leasekit_kv_handshake_listener_up``:
    up is 0 when any engine reports 0, None when no engine reports (a D, a stock P, or a P that has
    not stepped since it started)."""
    samples = series.get(m.HANDSHAKE_LISTENER_UP.name, ())
    down = sorted({s.labels.get("engine", "") for s in samples if s.value == 0})
    return {"up": None if not samples else (0 if down else 1), "down_engines": down}


_CONFIG = {"lease_duration_s": m.DURATION.name, "heartbeat_interval_s": m.HEARTBEAT_INTERVAL.name,
           "extension_s": m.EXTENSION.name}
_LEASEKIT_SAMPLE_NAMES = frozenset(n for spec in m.LEASEKIT_METRICS for n in spec.sample_names)
_LEASEKIT_FAMILIES = frozenset(spec.name for spec in m.LEASEKIT_METRICS)
_RANK_KEYS = tuple(GAUGES) + tuple(COUNTERS)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _by_name(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        out[s.name].append(s)
    return out


def _rank_sort_key(row: dict[str, Any]) -> tuple:
    rank = row["tp_rank"]
    return (row["engine"], 0 if rank.isdigit() else 1, int(rank) if rank.isdigit() else 0, rank)


def _config(series: dict[str, list[Sample]], notes: list[str]) -> dict[str, Any]:
    roles = sorted({s.labels["kv_role"] for name in _CONFIG.values() for s in series.get(name, ())
                    if s.labels.get("kv_role")})
    config: dict[str, Any] = {"kv_roles": roles}
    for key, name in _CONFIG.items():
        values = sorted({s.value for s in series.get(name, ())})
        config[key] = _number(values[0]) if len(values) == 1 else None
        if len(values) > 1:
            notes.append(f"{name} differs across engines/roles: {', '.join(map(str, map(_number, values)))}")
    L = config["lease_duration_s"]
    if L is not None:
        try:
            timing = LeaseTiming.from_lease_duration(L)
        except LeaseConfigError as exc:
            notes.append(f"exported lease duration: {exc}")
        else:
            for key, want in (("heartbeat_interval_s", timing.heartbeat_interval_s),
                              ("extension_s", timing.extension_s)):
                if config[key] is not None and config[key] != want:
                    notes.append(f"{_CONFIG[key]}={config[key]} but L={L} gives {want} (vLLM's derivation)")
            notes.extend(f"config: {f}" for f in lint_timing_findings(timing))
    return config


def _sum_of_rank_max(samples: Iterable[Sample]) -> float:
    """Sum over ``engine`` of the max over ``tp_rank`` (other labels summed within a rank)."""
    per_rank: dict[tuple[str, str], float] = defaultdict(float)
    for s in samples:
        per_rank[(s.labels.get("engine", ""), s.labels.get("tp_rank", ""))] += s.value
    per_engine: dict[str, float] = {}
    for (engine, _rank), value in per_rank.items():
        per_engine[engine] = max(per_engine.get(engine, value), value)
    return sum(per_engine.values())


def summarize(samples: list[Sample], families: Iterable[str] = ()) -> dict[str, Any]:
    """Totals, breakdowns and per-rank rows of one server's samples.

    ``families``: the family names the scrape declared; a catalog family declared without samples
    (no lease recorded yet) still counts as the server exporting lease metrics.

    Returns:
        ``{"has_lease_metrics": bool, "has_vllm_nixl_metrics": bool, "config": {kv_roles,
        lease_duration_s, heartbeat_interval_s, extension_s}, "gauges": {key: n}, "counters":
        {key: n, "vllm:nixl_...": n, "handshake_...": n}, "breakdown": {key: {label value: n}},
        "listener": {"up": 1|0|None, "down_engines": [engine]}, "ranks": [{engine, tp_rank, <gauge
        and counter keys>}], "notes": [str]}``; ``breakdown["handshake_bad_requests_by_reason"]``
        lists non-zero reasons only. Gauges are the sum over engines of the
        max over TP ranks (every rank pins its share of the same requests' blocks and holds its own
        lease on the same requests: summing ranks would multiply by the TP size; the same rule as the
        dashboard and LeasePinnedBlocksHigh). Counters are summed over every label (they count per
        request per rank, as their help texts say); ``ranks`` has one row per ``(engine, tp_rank)``.
    """
    series = _by_name(samples)
    notes: list[str] = []
    gauges = {k: _number(_sum_of_rank_max(series.get(n, ()))) for k, n in GAUGES.items()}
    counters = {k: _number(sum(s.value for s in series.get(n, ()))) for k, n in COUNTERS.items()}
    counters.update({k: _number(sum(s.value for s in series.get(n, ()))) for k, n in VLLM_COUNTERS.items()})
    counters.update({k: _number(sum(s.value for s in series.get(n, ()))) for k, n in LISTENER_COUNTERS.items()})
    breakdown: dict[str, dict[str, int | float]] = {}
    for key, (name, label) in BREAKDOWNS.items():
        acc: dict[str, float] = defaultdict(float)
        for s in series.get(name, ()):
            acc[s.labels.get(label, "")] += s.value
        breakdown[key] = {k: _number(v) for k, v in sorted(acc.items())}
    bad_by_reason: dict[str, float] = defaultdict(float)
    for s in series.get(LISTENER_COUNTERS["handshake_bad_requests"], ()):
        bad_by_reason[s.labels.get("reason", "")] += s.value
    breakdown[_BAD_HANDSHAKES_BY_REASON] = {k: _number(v) for k, v in sorted(bad_by_reason.items()) if v}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key in _RANK_KEYS:
        name = GAUGES.get(key) or COUNTERS[key]
        for s in series.get(name, ()):
            if "tp_rank" not in s.labels:
                continue
            ident = (s.labels.get("engine", ""), s.labels["tp_rank"])
            row = rows.setdefault(ident, {"engine": ident[0], "tp_rank": ident[1], **{k: 0 for k in _RANK_KEYS}})
            row[key] = _number(row[key] + s.value)
    families = frozenset(families)
    lease_samples = any(s.name in _LEASEKIT_SAMPLE_NAMES for s in samples)
    declared = bool(families & _LEASEKIT_FAMILIES)
    if declared and not lease_samples:
        notes.append("leasekit metrics are declared but have no samples yet: no lease recorded since start")
    return {
        "has_lease_metrics": lease_samples or declared,
        "has_vllm_nixl_metrics": any(s.name.startswith("vllm:nixl_") for s in samples)
        or any(f.startswith("vllm:nixl_") for f in families),
        "config": _config(series, notes),
        "gauges": gauges,
        "counters": counters,
        "breakdown": breakdown,
        "listener": _listener(series),
        "ranks": sorted(rows.values(), key=_rank_sort_key),
        "notes": notes,
    }


def verdict(summary: dict[str, Any], *, window: str = "since start") -> tuple[str, list[str]]:
    """The health verdict of a :func:`summarize` result and the reasons for it (see the module doc).

    Args:
        summary: from :func:`summarize` (counters as totals or as deltas).
        window: how the counters were taken, for the reason texts (``"since start"``, ``"in 10.0 s"``).

    Returns:
        ``(verdict, reasons)``; ``reasons`` lists every finding that is not OK (empty for OK), and
        for ``NO_LEASE_METRICS`` what the server does export.
    """
    c, g, b = summary["counters"], summary["gauges"], summary["breakdown"]
    if not summary["has_lease_metrics"]:
        if summary["has_vllm_nixl_metrics"]:
            why = ("exports vLLM's vllm:nixl_* metrics but no leasekit_* metrics: a stock NixlConnector, "
                   "not LeaseKitConnector (lease health needs kv_connector=LeaseKitConnector)")
        else:
            why = ("exports no leasekit_* and no vllm:nixl_* metrics: not a NIXL P/D server, or its KV "
                   "connector is not configured")
        reasons = [why]
        for key in ("vllm:nixl_num_notifications_after_expiry", "vllm:nixl_num_kv_expired_reqs"):
            if c[key] > 0:
                reasons.append(f"{key} = {_number(c[key])} {window}")
        if c["vllm:nixl_num_notifications_after_expiry"] > 0:  # a stock P that served late reads
            return CRITICAL, reasons
        return NO_LEASE_METRICS, reasons
    critical: list[str] = []
    degraded: list[str] = []
    discarded_late = b.get("late_completions_by_fail_closed", {}).get("true", 0)
    unprotected_late = c["late_completions"] - discarded_late
    if unprotected_late > 0:
        by = ", ".join(f"{k}={v}" for k, v in b["late_completions_by_tp_rank"].items())
        critical.append(f"{_number(unprotected_late)} late completion(s) {window} from D agents that do not fail "
                        f"closed (all late completions by tp_rank: {by}): D read "
                        "blocks of a lease P had already ended; the read may have used freed KV blocks")
    if discarded_late > 0:
        degraded.append(f"{_number(discarded_late)} late completion(s) {window} from fail-closed D agents: P told "
                        "them to discard those reads (recomputed or failed per kv_load_failure_policy)")
    if c["vllm:nixl_num_notifications_after_expiry"] > discarded_late:
        critical.append(f"vllm:nixl_num_notifications_after_expiry = {c['vllm:nixl_num_notifications_after_expiry']} "
                        f"{window}: read completions for expired requests (vLLM's count"
                        + (f"; {_number(discarded_late)} of them were discarded by fail-closed D agents)" if discarded_late else ")"))
    listener = summary.get("listener") or {}
    if listener.get("up") == 0:
        critical.append(f"NIXL handshake listener down (engine {', '.join(listener['down_engines'])}): no new D "
                        "engine can connect to this P, although /health answers 200")
    if c["expiries"] > 0:
        causes = ", ".join(f"{k}={v}" for k, v in b["expiries_by_cause"].items())
        states = ", ".join(f"{k}={v}" for k, v in b["expiries_by_peer_state"].items())
        noun = "expiry" if c["expiries"] == 1 else "expiries"
        returned = c.get("expired_peer_returns", 0)
        degraded.append(f"{c['expiries']} lease {noun} {window} (by cause: {causes}; by D state at the reap: "
                        f"{states}" + (f"; {returned} of a silent D that came back: stalled, not dead" if returned
                                       else "") + ")")
    if c["vllm:nixl_num_kv_expired_reqs"] > 0:
        degraded.append(f"vllm:nixl_num_kv_expired_reqs = {c['vllm:nixl_num_kv_expired_reqs']} {window}")
    if g["expiring_soon"] > 0:
        degraded.append(f"{g['expiring_soon']} lease(s) expiring soon now (deadline < H away: a heartbeat is overdue)")
    if c["heartbeat_send_failures"] > 0:
        by = ", ".join(f"{k}={v}" for k, v in b[_HB_FAIL_BY_REMOTE].items())
        degraded.append(f"{c['heartbeat_send_failures']} heartbeat send failure(s) {window} (by "
                        f"{remote_label(m.HEARTBEAT_SEND_FAILURES)}: {by})")
    reads = b.get("reads_by_outcome", {})
    discarded = sum(reads.get(outcome, 0) for outcome in ("reaped", "timeout", "ungated"))
    if discarded > 0:
        degraded.append(f"{_number(discarded)} read(s) of P's KV blocks discarded {window} (reaped="
                        f"{_number(reads.get('reaped', 0))}, timeout={_number(reads.get('timeout', 0))}, ungated="
                        f"{_number(reads.get('ungated', 0))}): their "
                        "leases had expired or P did not confirm them; vLLM's kv_load_failure_policy recomputed "
                        "or failed those requests, no wrong tokens were served")
    if c.get("handshake_bad_requests", 0) > 0:
        by = ", ".join(f"{k}={v}" for k, v in b.get(_BAD_HANDSHAKES_BY_REASON, {}).items())
        degraded.append(f"{c['handshake_bad_requests']} malformed handshake request(s) refused {window} (by reason: "
                        f"{by}): a D with a mismatched config, or a foreign client, could not connect")
    if critical:
        return CRITICAL, critical + degraded
    if degraded:
        return DEGRADED, degraded
    return OK, []
