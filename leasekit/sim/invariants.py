"""Checkers for the invariants (docs/lease-model.md) over a finished :class:`~leasekit.sim.world.World`.

Each returns a list of violations (human-readable strings; empty = holds). They read the world's
own observations (step instants, heartbeat arrivals and processing, block pools), not the lease
table's internal deadlines, so a broken table cannot vouch for itself.
"""

from __future__ import annotations

import bisect

from leasekit.lease.table import Outcome
from leasekit.sim.world import World

EPS = 1e-6
"""Float slack (seconds): a step within EPS of a bound point may fall on either side of it."""


def bounded_reclaim(world: World) -> list[str]:
    """Invariant 1: a lease not released is reclaimed at the first P step at or after
    ``max(grant + L, last processed heartbeat + E)`` (P's local clock)."""
    L, E = world.p_timing.lease_duration_s, world.p_timing.extension_s
    steps = world.p_steps_local
    violations = []
    for lease in world.leases.values():
        if lease.outcome in (Outcome.RELEASED, Outcome.ABORTED):
            continue
        point = lease.granted_local + L
        if lease.hb_processed_local:
            point = max(point, max(lease.hb_processed_local) + E)
        i = bisect.bisect_left(steps, point + EPS)
        if i == len(steps):
            continue  # no P step at or after the bound yet (run ended, P dead or stalled)
        first_step = steps[i]
        if lease.end_local is None:
            violations.append(f"{lease.req_id}@r{lease.rank}: still pinned after the step at {first_step:.3f} >= bound point {point:.3f}")
        elif lease.end_local > first_step + EPS:
            violations.append(f"{lease.req_id}@r{lease.rank}: reclaimed at {lease.end_local:.3f}, first step after bound point {point:.3f} was {first_step:.3f}")
    return violations


def no_premature_reclaim(world: World) -> list[str]:
    """Invariant 2: a lease never expires before ``grant + L``, nor before ``local(a) + E`` for any
    heartbeat naming it that arrived at P at or before the reaping step (drain before reap)."""
    L, E = world.p_timing.lease_duration_s, world.p_timing.extension_s
    clock = world.config.p_clock
    violations = []
    for lease in world.leases.values():
        if lease.outcome is not Outcome.EXPIRED:
            continue
        lower = lease.granted_local + L
        arrived = [clock.local(a) for a in lease.hb_arrivals_true if a <= lease.end_true + EPS]
        if arrived:
            lower = max(lower, max(arrived) + E)
        if lease.end_local < lower - EPS:
            violations.append(f"{lease.req_id}@r{lease.rank}: expired at {lease.end_local:.3f} before {lower:.3f}")
    return violations


def reaper_complete(world: World) -> list[str]:
    """Invariant 3: after every reap no live lease has ``deadline <= now``."""
    return list(world.reaper_violations)


def fail_closed(world: World) -> list[str]:
    """Invariant 5: a read of freed, reused or invalid blocks is never served as tokens."""
    return [
        f"{r.spec.req_id}: read saw {r.read_result} blocks but was served"
        for r in world.requests.values()
        if r.read_result not in (None, "ok") and r.d_outcome == "served"
    ]


def idempotent_release(world: World) -> list[str]:
    """Invariant 6: every lease is freed exactly once; no double free in any block pool."""
    violations = [f"{l.req_id}@r{l.rank}: freed {l.frees} times" for l in world.leases.values() if l.frees > 1]
    for rank, pool in enumerate(world.pools):
        if pool.violations["double_free"]:
            violations.append(f"rank {rank}: {pool.violations['double_free']} double free(s)")
    return violations


def conservation(world: World) -> list[str]:
    """Invariant 8: with traffic stopped and every bound passed, no block stays pinned."""
    return [f"rank {rank}: {pinned} block(s) still pinned" for rank, pinned in enumerate(world.pinned_blocks()) if pinned]


def false_expiries(world: World) -> list[str]:
    """No false expiry while D is healthy: a lease must not expire before D reads its request.
    (A precondition for the caller: D alive, unstalled and lossless for that request.)"""
    violations = []
    for record in world.requests.values():
        if record.read_done_true is None:
            continue
        for lease in world.leases.values():
            if lease.req_id == record.spec.req_id and lease.outcome is Outcome.EXPIRED and lease.end_true < record.read_done_true:
                violations.append(f"{lease.req_id}@r{lease.rank}: expired at t={lease.end_true:.3f} before D's read at t={record.read_done_true:.3f}")
    return violations


ALL = {
    "bounded_reclaim": bounded_reclaim,
    "no_premature_reclaim": no_premature_reclaim,
    "reaper_complete": reaper_complete,
    "fail_closed": fail_closed,
    "idempotent_release": idempotent_release,
}


def check_all(world: World, *, quiescent: bool = False) -> dict[str, list[str]]:
    """Run every always-true invariant (and conservation when ``quiescent``); only failing ones."""
    checks = dict(ALL)
    if quiescent:
        checks["conservation"] = conservation
    return {name: v for name, fn in checks.items() if (v := fn(world))}
