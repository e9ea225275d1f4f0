"""The checker: verdicts from lease timelines against the bounds of ``leasekit.lease.bounds``.

Every verdict carries the bound, the measured value and the lease timeline that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.cluster.router import DecodeResult
from leasekit.lease.bounds import reclaim_bound, reclaim_deadline
from leasekit.lease.config import LeaseTiming
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_timeline import LeaseTimeline

EARLY_TOLERANCE_S = 1e-3
"""Float slack when testing "not before the deadline" (seconds)."""

HEARTBEAT_IN_FLIGHT_S = 0.5
"""A heartbeat D sent just before the fault may still be delivered this long after it (seconds)."""

RECLAIM_BOUND_TEXT = "reclaim <= max(grant + L, last delivered heartbeat + E) + tick, and not before max(grant + L, last heartbeat + E)"


@dataclass
class LeaseVerdict:
    """The verdict for one lease: times are seconds after the lease's grant (P's clock)."""

    request_id: str
    verdict: str
    reason: str
    bound_s: float | None = None
    measured_s: float | None = None
    lease: LeaseTimeline | None = None
    fault_s: float | None = None
    not_before_s: float | None = None

    def to_json(self) -> dict:
        """JSON-ready dict: verdict, reason, bound, measured value and the lease timeline."""
        return {
            "request_id": self.request_id,
            "verdict": self.verdict,
            "reason": self.reason,
            "bound_after_grant_s": self.bound_s,
            "not_before_after_grant_s": self.not_before_s,
            "reclaimed_after_grant_s": self.measured_s,
            "fault_after_grant_s": self.fault_s,
            "lease": None if self.lease is None else self.lease.to_json(),
        }


@dataclass
class CheckResult:
    """An aggregate verdict with its evidence (``details``) and per-lease rows."""

    name: str
    verdict: str
    summary: str
    rows: list[LeaseVerdict] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """JSON-ready dict."""
        return {
            "check": self.name,
            "verdict": self.verdict,
            "summary": self.summary,
            "details": self.details,
            "leases": [row.to_json() for row in self.rows],
        }


def _by_request(leases: Iterable[LeaseTimeline]) -> dict[str, list[LeaseTimeline]]:
    grouped: dict[str, list[LeaseTimeline]] = {}
    for lease in leases:
        grouped.setdefault(lease.request_id, []).append(lease)
    return grouped


def check_lease_reclaim(
    lease: LeaseTimeline, timing: LeaseTiming, tick_s: float, fault_at_s: float | None = None
) -> LeaseVerdict:
    """Bounded and not-premature reclaim for one lease after its D went silent.

    Args:
        lease: the ended lease (P's clock).
        timing: the lease timing the scenario runs with.
        tick_s: allowance for P's step period (seconds).
        fault_at_s: when D was silenced, converted to P's clock; None skips the fault-window checks.

    PASS: expired no earlier than ``max(grant + L, last_hb + E)`` (less the evidence's
    ``stamp_latency_s``: a logged heartbeat may be stamped late) and no later than that plus
    ``tick_s``. FAIL: expired early or late, or ended ``aborted``. UNKNOWN: the lease did not meet the
    fault (it ended before ``fault_at_s``, or heartbeats kept arriving after it), it was released
    (D read it), or P ran with a different lease duration. ``grant + L`` is P's own stamp (initial
    deadline - L); the heartbeat and reclaim instants are measured independently of vLLM's deadline.
    """
    if abs(lease.lease_duration_s - float(timing.lease_duration_s)) > 1e-9:
        return LeaseVerdict(
            lease.request_id, UNKNOWN,
            f"P ran with L={lease.lease_duration_s} s, the scenario expects L={timing.lease_duration_s} s",
            lease=lease,
        )
    lower = reclaim_deadline(timing, lease.grant_s, lease.last_heartbeat_s)
    upper = reclaim_bound(timing, lease.grant_s, lease.last_heartbeat_s, tick_s)
    bound_rel, measured_rel = upper - lease.grant_s, lease.end_s - lease.grant_s

    def row(verdict: str, reason: str) -> LeaseVerdict:
        return LeaseVerdict(lease.request_id, verdict, reason, bound_rel, measured_rel, lease,
                            None if fault_at_s is None else fault_at_s - lease.grant_s, lower - lease.grant_s)

    if fault_at_s is not None:
        if lease.end_s < fault_at_s:
            return row(UNKNOWN, f"ended {lease.outcome} {fault_at_s - lease.end_s:.3f} s before the fault: not exercised")
        late = [t for t in lease.heartbeats_s if t > fault_at_s + max(tick_s, HEARTBEAT_IN_FLIGHT_S)]
        if late:
            return row(UNKNOWN, f"a heartbeat arrived {late[-1] - fault_at_s:.3f} s after the fault: D was not silenced")
    if lease.outcome == sc.OUTCOME_RELEASED:
        return row(UNKNOWN, "released: D read it, the bound was not exercised")
    if lease.outcome != sc.OUTCOME_EXPIRED:
        return row(FAIL, f"ended {lease.outcome}, not by expiry")
    if lease.end_s < lower - EARLY_TOLERANCE_S - lease.stamp_latency_s:
        return row(FAIL, f"expired {lower - lease.end_s:.3f} s before max(grant + L, last heartbeat + E) (premature reclaim)")
    uncertain = ""
    if lease.end_s < lower - EARLY_TOLERANCE_S:
        uncertain = (f"; {lower - lease.end_s:.3f} s before the deadline computed from the logged heartbeat, "
                     f"within the log-stamp uncertainty {lease.stamp_latency_s:g} s")
    if lease.end_s > upper:
        return row(FAIL, f"reclaimed {lease.end_s - upper:.3f} s after the bound (step gap {lease.step_gap_s})")
    if lease.heartbeat_count == 0:
        how = "no heartbeat delivered"
    elif lower > lease.grant_s + timing.lease_duration_s:
        how = "last heartbeat + E set it"
    else:
        how = "grant + L set it"
    return row(PASS, f"in bound; {how}{uncertain}")


def check_bounded_reclaim(
    leases: Iterable[LeaseTimeline], request_ids: Iterable[str], timing: LeaseTiming, tick_s: float,
    *, fault_at_s: float | None = None, waited_s: float | None = None, partial: bool = False,
) -> CheckResult:
    """Invariant 1 (bounded reclaim) and 2 (no premature reclaim) over the faulted requests.

    ``fault_at_s`` is the fault instant on P's clock (see :func:`check_lease_reclaim`). A request
    with no ended lease is FAIL (still pinned after the wait), or UNKNOWN when ``partial`` (the run
    was interrupted before the wait was over). The aggregate is FAIL if any row fails; UNKNOWN
    unless at least one lease was open at the fault, had a heartbeat delivered before it and was
    reclaimed in bound (otherwise the fault did not exercise the bound); else PASS.
    """
    grouped = _by_request(leases)
    rows: list[LeaseVerdict] = []
    for request_id in request_ids:
        found = grouped.get(request_id)
        if not found:
            if partial:
                rows.append(LeaseVerdict(request_id, UNKNOWN, "interrupted before this lease ended"))
                continue
            waited = "" if waited_s is None else f" {waited_s:.1f} s after the fault"
            rows.append(LeaseVerdict(request_id, FAIL, f"no lease end observed{waited}: blocks still pinned"))
            continue
        rows.extend(check_lease_reclaim(lease, timing, tick_s, fault_at_s) for lease in found)

    def exercised(r: LeaseVerdict) -> bool:
        if r.verdict != PASS or r.lease is None or r.lease.last_heartbeat_s is None:
            return False
        return fault_at_s is None or r.lease.heartbeats_s[0] <= fault_at_s

    failed = [r for r in rows if r.verdict == FAIL]
    good = [r for r in rows if exercised(r)]
    if failed:
        verdict, summary = FAIL, f"{len(failed)}/{len(rows)} lease(s) violate the reclaim bound"
    elif not good:
        verdict, summary = UNKNOWN, "no lease open at the fault was reclaimed by expiry after a heartbeat: the fault did not exercise the bound"
    else:
        verdict, summary = PASS, f"{len(good)}/{len(rows)} lease(s) reclaimed within the bound after heartbeats"
    margins = [r.bound_s - r.measured_s for r in rows if r.bound_s is not None and r.measured_s is not None and r.verdict == PASS]
    return CheckResult(
        "bounded-reclaim", verdict, summary, rows,
        {
            "bound": RECLAIM_BOUND_TEXT,
            "lease_duration_s": timing.lease_duration_s,
            "heartbeat_interval_s": timing.heartbeat_interval_s,
            "extension_s": timing.extension_s,
            "tick_s": tick_s,
            "fault_at_monotonic_s": fault_at_s,
            "min_margin_s": min(margins) if margins else None,
        },
    )


def check_steady_state(
    leases: Iterable[LeaseTimeline], request_ids: Iterable[str], decodes: Mapping[int, DecodeResult],
    timing: LeaseTiming, *, expiries_allowed: int = 0, all_served: bool = True,
) -> CheckResult:
    """The steady-state hypothesis: without the fault, no lease expires and every request is served.

    PASS when expiries <= ``expiries_allowed``, every other lease ended ``released`` and (if
    ``all_served``) every decode answered HTTP 200 with tokens. Evidence includes the longest life
    of a released lease, to show whether leases outlived ``L`` on heartbeats, and for each expiry
    whether it was premature (before ``max(grant + L, last heartbeat + E)``, the rule of
    ``leasekit.lease.bounds.reclaim_deadline``) or on time (P heard no heartbeat for ``E``:
    ``details["premature_expiries"]`` counts the former).
    """
    ids = list(request_ids)
    grouped = _by_request(leases)
    rows: list[LeaseVerdict] = []
    expired = early = 0
    for request_id in ids:
        found = grouped.get(request_id)
        if not found:
            rows.append(LeaseVerdict(request_id, FAIL, "no lease end observed"))
            continue
        for lease in found:
            life = lease.end_s - lease.grant_s
            if lease.outcome == sc.OUTCOME_EXPIRED:
                expired += 1
                lower = reclaim_deadline(timing, lease.grant_s, lease.last_heartbeat_s)
                if lease.end_s < lower - EARLY_TOLERANCE_S - lease.stamp_latency_s:
                    early += 1
                    how = f"{lower - lease.end_s:.3f} s before max(grant + L, last heartbeat + E) (premature reclaim)"
                elif lease.last_heartbeat_s is None:
                    how = f"on time: P heard no heartbeat in L = {timing.lease_duration_s:g} s"
                else:
                    how = (f"on time: P heard no heartbeat for {lease.end_s - lease.last_heartbeat_s:.3f} s "
                           f"(E = {timing.extension_s:g} s)")
                rows.append(LeaseVerdict(request_id, FAIL, f"expired after {life:.3f} s with {lease.heartbeat_count} heartbeat(s), {how}",
                                         None, life, lease, None, lower - lease.grant_s))
            elif lease.outcome != sc.OUTCOME_RELEASED:
                rows.append(LeaseVerdict(request_id, FAIL, f"ended {lease.outcome}", None, life, lease))
            else:
                rows.append(LeaseVerdict(request_id, PASS, f"released after {life:.3f} s, {lease.heartbeat_count} heartbeat(s)", None, life, lease))
    if 0 < expired <= expiries_allowed:
        for r in rows:
            if r.lease is not None and r.lease.outcome == sc.OUTCOME_EXPIRED and "premature" not in r.reason:
                r.verdict, r.reason = PASS, f"{r.reason} (within steady_state.expiries = {expiries_allowed})"
    served = sum(1 for r in decodes.values() if r.ok)
    not_served = [f"#{i}: HTTP {r.status} {r.error or ''}".strip() for i, r in sorted(decodes.items()) if not r.ok]
    lives = [r.measured_s for r in rows if r.measured_s is not None and r.lease is not None and r.lease.outcome == sc.OUTCOME_RELEASED]
    longest = max(lives) if lives else None
    problems = []
    if expired > expiries_allowed:
        problems.append(f"{expired} expiries (allowed {expiries_allowed}{f', {early} premature' if early else ''})")
    elif early:
        problems.append(f"{early} premature expiries")
    unreleased = any(r.verdict == FAIL and (r.lease is None or r.lease.outcome != sc.OUTCOME_EXPIRED) for r in rows)
    if unreleased:
        problems.append("lease(s) not released")
    if all_served and served < len(ids):
        problems.append(f"{len(ids) - served}/{len(ids)} request(s) not served")
    expired_ids = {r.request_id for r in rows if r.lease is not None and r.lease.outcome == sc.OUTCOME_EXPIRED}
    unserved_ids = [rid for (_, d), rid in zip(sorted(decodes.items()), ids) if not d.ok] if len(decodes) == len(ids) else None
    # every failure comes from a lease that expired on time (its request then unanswered): see on_time_only
    explained = (early == 0 and expired > 0 and unserved_ids is not None and set(unserved_ids) <= expired_ids
                 and not unreleased)
    verdict = FAIL if problems else PASS
    summary = "; ".join(problems) if problems else f"{served}/{len(ids)} request(s) served, {expired} expiries"
    return CheckResult(
        "steady-state", verdict, summary, rows,
        {
            "expiries": expired,
            "premature_expiries": early,
            "only_on_time_expiries": bool(problems) and explained,
            "expiries_allowed": expiries_allowed,
            "served": served,
            "requests": len(ids),
            "not_served": not_served,
            "longest_lease_s": longest,
            "lease_duration_s": timing.lease_duration_s,
            "leases_outlived_L_on_heartbeats": longest is not None and longest > float(timing.lease_duration_s),
        },
    )


def check_no_expiry(leases: Iterable[LeaseTimeline], request_ids: Iterable[str], timing: LeaseTiming) -> CheckResult:
    """No lease of ``request_ids`` expired (invariant 2 while D is healthy or only briefly stalled).

    FAIL lists each expired lease with its heartbeats; UNKNOWN when a request has no ended lease
    in the evidence (missing evidence must never read as "nothing expired").
    """
    grouped = _by_request(leases)
    rows = []
    for request_id in request_ids:
        if not grouped.get(request_id):
            rows.append(LeaseVerdict(request_id, UNKNOWN, "no lease end in P's evidence"))
        for lease in grouped.get(request_id, []):
            life = lease.end_s - lease.grant_s
            if lease.outcome == sc.OUTCOME_EXPIRED:
                last = lease.relative(lease.last_heartbeat_s)
                rows.append(LeaseVerdict(request_id, FAIL, f"expired after {life:.3f} s, last heartbeat at {last if last is None else round(last, 3)} s", None, life, lease))
            else:
                rows.append(LeaseVerdict(request_id, PASS, f"{lease.outcome} after {life:.3f} s, {lease.heartbeat_count} heartbeat(s)", None, life, lease))
    expired = [r for r in rows if r.verdict == FAIL]
    missing = [r for r in rows if r.verdict == UNKNOWN]
    verdict = FAIL if expired else UNKNOWN if missing or not rows else PASS
    summary = (f"{len(expired)} lease(s) expired" if expired else
               f"{len(missing)} of {len(rows)} request(s) have no ended lease in the evidence" if missing else
               "no lease to judge" if not rows else f"0 of {len(rows)} lease(s) expired")
    return CheckResult("no-expiry", verdict, summary, rows, {"expired": len(expired), "leases": len(rows),
                                                              "lease_duration_s": timing.lease_duration_s})


def check_all_served(decodes: Mapping[int, DecodeResult], expected: Iterable[int]) -> CheckResult:
    """Every request meant to be decoded answered HTTP 200 with tokens."""
    expected = list(expected)
    missing = [i for i in expected if i not in decodes]
    failed = [f"#{i}: HTTP {decodes[i].status} {decodes[i].error or ''}".strip() for i in expected if i in decodes and not decodes[i].ok]
    problems = missing + failed
    verdict = FAIL if problems else PASS
    summary = f"{len(expected) - len(problems)}/{len(expected)} served" + (f"; not served: {problems[:5]}" if problems else "")
    return CheckResult("all-served", verdict, summary, details={"expected": len(expected), "missing": missing, "failed": failed})


def check_fail_closed(leases: Iterable[LeaseTimeline], served: Mapping[str, float], late_reads: Mapping[str, float],
                      discarded: Mapping[str, str] | None = None,
                      recompute_matches: Mapping[str, bool | None] | None = None) -> CheckResult:
    """Invariant 5: no tokens from an expired lease.

    ``served``: request id -> when D's HTTP 200 answer arrived, converted to P's evidence clock.
    ``late_reads``: request id -> when P saw a read completion after the lease had ended.
    ``discarded``: request id -> the outcome (``reaped`` | ``timeout``) with which LeaseKit D's read gate
    discarded its read (D's ``kv_lease_read`` spans; docs/fail-closed.md), so vLLM recomputed or failed it.
    ``recompute_matches``: request id -> whether the tokens D served equal a fresh routed run of the
    same prompt (None: the comparison could not be made).

    A request served after its lease expired FAILs unless D discarded its read and the tokens it served
    equal the fresh run's (then it was recomputed: PASS); discarded but not compared is UNKNOWN. A late
    read that D did not serve (error) is the fail-closed outcome too.
    """
    discarded = discarded or {}
    recompute_matches = recompute_matches or {}
    rows = []
    for lease in leases:
        if lease.outcome != sc.OUTCOME_EXPIRED:
            continue
        rid = lease.request_id
        answered = served.get(rid)
        seen = late_reads.get(rid)
        detected = "P saw the late read" if seen is not None else "P never saw it"
        if answered is not None and answered > lease.end_s:
            late = f"HTTP 200 {answered - lease.end_s:.3f} s after its lease expired"
            how = discarded.get(rid)
            match = recompute_matches.get(rid)
            if how is None:
                rows.append(LeaseVerdict(rid, FAIL, f"{late} from the read ({detected}; D did not discard it)",
                                         None, answered - lease.grant_s, lease))
            elif match is True:
                rows.append(LeaseVerdict(rid, PASS, f"{late}: D discarded the read ({how}) and recomputed; "
                                         "tokens equal a fresh run", None, answered - lease.grant_s, lease))
            elif match is False:
                rows.append(LeaseVerdict(rid, FAIL, f"{late}: D discarded the read ({how}) but its tokens differ "
                                         "from a fresh run", None, answered - lease.grant_s, lease))
            else:
                rows.append(LeaseVerdict(rid, UNKNOWN, f"{late}: D discarded the read ({how}); tokens not compared",
                                         None, answered - lease.grant_s, lease))
        elif seen is not None or rid in discarded:
            how = f"D discarded it ({discarded[rid]})" if rid in discarded else "P saw it"
            rows.append(LeaseVerdict(rid, PASS, f"late read detected ({how}) and not served", None,
                                     (seen if seen is not None else lease.end_s) - lease.grant_s, lease))
    failed = [r for r in rows if r.verdict == FAIL]
    unknown = [r for r in rows if r.verdict == UNKNOWN]
    if failed:
        verdict, summary = FAIL, f"{len(failed)} request(s) served tokens from an expired lease"
    elif unknown:
        verdict, summary = UNKNOWN, f"{len(unknown)} discarded read(s) served without an output comparison"
    elif rows:
        recomputed = sum(1 for r in rows if "recomputed" in r.reason)
        verdict, summary = PASS, f"{len(rows)} late read(s), none served from freed blocks ({recomputed} recomputed)"
    else:
        verdict, summary = UNKNOWN, "no read of an expired lease happened: fail-closed not exercised"
    return CheckResult("fail-closed", verdict, summary, rows,
                       {"late_reads_seen_by_p": len(late_reads), "reads_discarded_by_d": len(discarded)})


def on_time_only(check: CheckResult) -> bool:
    """Whether the steady-state ``check`` failed only through leases that expired on time (P heard
    no heartbeat for E, or none in L; none premature): no fault was injected, so the pair could not
    keep its heartbeats flowing at that moment (an overloaded host). A defect that stops heartbeats
    fails every attempt; a premature expiry, a lease that was never ended, or a request left
    unanswered whose lease did not expire is never this."""
    return check.verdict == FAIL and bool(check.details.get("only_on_time_expiries"))
