"""The checker: verdicts from lease timelines against the bounds of ``leasekit.lease.bounds``.

Every verdict carries the bound, the measured value and the lease timeline that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.leases import LeaseTimeline
from leasekit.cluster.router import DecodeResult
from leasekit.lease.bounds import reclaim_bound, reclaim_deadline
from leasekit.lease.config import LeaseTiming
from leasekit.telemetry import semconv as sc

EARLY_TOLERANCE_S = 1e-3
"""Float slack when testing "not before the deadline" (seconds)."""

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

    def to_json(self) -> dict:
        """JSON-ready dict: verdict, reason, bound, measured value and the lease timeline."""
        return {
            "request_id": self.request_id,
            "verdict": self.verdict,
            "reason": self.reason,
            "bound_after_grant_s": self.bound_s,
            "reclaimed_after_grant_s": self.measured_s,
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


def check_lease_reclaim(lease: LeaseTimeline, timing: LeaseTiming, tick_s: float) -> LeaseVerdict:
    """Bounded and not-premature reclaim for one lease after its D went silent.

    PASS: expired no earlier than ``max(grant + L, last_hb + E)`` and no later than that plus
    ``tick_s``. FAIL: expired early or late, or ended ``aborted``. UNKNOWN: released (D read it:
    the fault did not exercise this lease) or P ran with a different lease duration.
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
    if lease.outcome == sc.OUTCOME_RELEASED:
        return LeaseVerdict(lease.request_id, UNKNOWN, "released: D read it before the fault, bound not exercised",
                            bound_rel, measured_rel, lease)
    if lease.outcome != sc.OUTCOME_EXPIRED:
        return LeaseVerdict(lease.request_id, FAIL, f"ended {lease.outcome}, not by expiry", bound_rel, measured_rel, lease)
    if lease.end_s < lower - EARLY_TOLERANCE_S:
        return LeaseVerdict(
            lease.request_id, FAIL,
            f"expired {lower - lease.end_s:.3f} s before max(grant + L, last heartbeat + E) (premature reclaim)",
            bound_rel, measured_rel, lease,
        )
    if lease.end_s > upper:
        return LeaseVerdict(
            lease.request_id, FAIL,
            f"reclaimed {lease.end_s - upper:.3f} s after the bound (step gap {lease.step_gap_s})",
            bound_rel, measured_rel, lease,
        )
    if lease.heartbeat_count == 0:
        how = "no heartbeat delivered"
    elif lower > lease.grant_s + timing.lease_duration_s:
        how = f"{lease.heartbeat_count} heartbeat(s); the last heartbeat set the bound"
    else:
        how = f"{lease.heartbeat_count} heartbeat(s); grant + L set the bound"
    return LeaseVerdict(lease.request_id, PASS, f"reclaimed within bound, {how}", bound_rel, measured_rel, lease)


def check_bounded_reclaim(
    leases: Iterable[LeaseTimeline], request_ids: Iterable[str], timing: LeaseTiming, tick_s: float,
    *, waited_s: float | None = None, partial: bool = False,
) -> CheckResult:
    """Invariant 1 (bounded reclaim) and 2 (no premature reclaim) over the faulted requests.

    A request with no ended lease is FAIL (still pinned after the wait), or UNKNOWN when ``partial``
    (the run was interrupted before the wait was over). The aggregate is FAIL if any
    row fails, UNKNOWN if no lease was reclaimed by expiry after at least one heartbeat (the fault did
    not exercise the heartbeat path), else PASS.
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
        rows.extend(check_lease_reclaim(lease, timing, tick_s) for lease in found)
    failed = [r for r in rows if r.verdict == FAIL]
    exercised = [r for r in rows if r.verdict == PASS and r.lease is not None and r.lease.heartbeat_count > 0]
    if failed:
        verdict, summary = FAIL, f"{len(failed)}/{len(rows)} lease(s) violate the reclaim bound"
    elif not exercised:
        verdict, summary = UNKNOWN, "no lease was reclaimed by expiry after a heartbeat: the fault did not exercise the bound"
    else:
        verdict, summary = PASS, f"{len(exercised)}/{len(rows)} lease(s) reclaimed within the bound after heartbeats"
    margins = [r.bound_s - r.measured_s for r in rows if r.bound_s is not None and r.measured_s is not None and r.verdict == PASS]
    return CheckResult(
        "bounded-reclaim", verdict, summary, rows,
        {
            "bound": RECLAIM_BOUND_TEXT,
            "lease_duration_s": timing.lease_duration_s,
            "heartbeat_interval_s": timing.heartbeat_interval_s,
            "extension_s": timing.extension_s,
            "tick_s": tick_s,
            "min_margin_s": min(margins) if margins else None,
        },
    )


def check_steady_state(
    leases: Iterable[LeaseTimeline], request_ids: Iterable[str], decodes: Mapping[int, DecodeResult],
    timing: LeaseTiming, *, expiries_allowed: int = 0, all_served: bool = True,
) -> CheckResult:
    """The steady-state hypothesis: without the fault, no lease expires and every request is served.

    PASS when expiries <= ``expiries_allowed``, every lease ended ``released`` and (if
    ``all_served``) every decode answered HTTP 200 with tokens. Evidence includes the longest lease
    life, to show whether leases outlived ``L`` on heartbeats.
    """
    ids = list(request_ids)
    grouped = _by_request(leases)
    rows: list[LeaseVerdict] = []
    expired = 0
    for request_id in ids:
        found = grouped.get(request_id)
        if not found:
            rows.append(LeaseVerdict(request_id, FAIL, "no lease end observed"))
            continue
        for lease in found:
            life = lease.end_s - lease.grant_s
            if lease.outcome == sc.OUTCOME_EXPIRED:
                expired += 1
                rows.append(LeaseVerdict(request_id, FAIL, f"expired after {life:.3f} s with {lease.heartbeat_count} heartbeat(s)", None, life, lease))
            elif lease.outcome != sc.OUTCOME_RELEASED:
                rows.append(LeaseVerdict(request_id, FAIL, f"ended {lease.outcome}", None, life, lease))
            else:
                rows.append(LeaseVerdict(request_id, PASS, f"released after {life:.3f} s, {lease.heartbeat_count} heartbeat(s)", None, life, lease))
    served = sum(1 for r in decodes.values() if r.ok)
    not_served = [f"#{i}: HTTP {r.status} {r.error or ''}".strip() for i, r in sorted(decodes.items()) if not r.ok]
    lives = [r.measured_s for r in rows if r.measured_s is not None]
    longest = max(lives) if lives else None
    problems = []
    if expired > expiries_allowed:
        problems.append(f"{expired} expiries (allowed {expiries_allowed})")
    if any(r.verdict == FAIL and (r.lease is None or r.lease.outcome != sc.OUTCOME_EXPIRED) for r in rows):
        problems.append("lease(s) not released")
    if all_served and served < len(ids):
        problems.append(f"{len(ids) - served}/{len(ids)} request(s) not served")
    verdict = FAIL if problems else PASS
    summary = "; ".join(problems) if problems else f"{len(ids)} request(s) served, 0 expiries"
    return CheckResult(
        "steady-state", verdict, summary, rows,
        {
            "expiries": expired,
            "expiries_allowed": expiries_allowed,
            "served": served,
            "requests": len(ids),
            "not_served": not_served,
            "longest_lease_s": longest,
            "lease_duration_s": timing.lease_duration_s,
            "leases_outlived_L_on_heartbeats": longest is not None and longest > float(timing.lease_duration_s),
        },
    )
