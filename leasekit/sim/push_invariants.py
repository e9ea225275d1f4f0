"""Checkers for push-mode worlds (``transfer_mode="push"``, :mod:`leasekit.sim.push`).

Each returns a list of violations (human-readable strings; empty = holds). Like
:mod:`leasekit.sim.invariants` they judge from the world's own observations (P's step instants, heartbeat
processing, the generation-counted block pools, when each WRITE was issued and completed), never from
what P's push side says it did, so a broken P cannot vouch for itself. The bounds are pull mode's
(:mod:`leasekit.lease.bounds`: reclaim at the first P step at or after ``max(grant + L, last processed
heartbeat + E)``; ``L``, ``E`` from :mod:`leasekit.lease.config`).

Always true (:data:`ALWAYS`, plus :func:`push_conservation` once quiet): a lease ends by its reclaim bound
whatever its outcome; never expires early; the reaper is complete; blocks are freed once; a lease is
released exactly when P first sees its WRITE done, and never otherwise; one WRITE per lease; a WRITE only
for a live lease; every WRITE that read freed blocks is a recorded late write and every late write is one.
True only without faults beyond the loss budget (:data:`HEALTHY`): no late write, no WRITE into a reused D
slot, no request served from freed or reused P blocks.
"""

from __future__ import annotations

import bisect

from leasekit.lease.table import Outcome
from leasekit.sim import invariants as inv
from leasekit.sim.records import LeaseRecord, WriteRecord
from leasekit.sim.world import World

EPS = inv.EPS


def _first_step(world: World, local_s: float) -> float | None:
    """The first P step at or after ``local_s`` (P's clock), or None (none yet)."""
    steps = world.p_steps_local
    i = bisect.bisect_left(steps, local_s - EPS)
    return steps[i] if i < len(steps) else None


def _writes(world: World) -> dict[tuple[str, int], list[WriteRecord]]:
    by_lease: dict[tuple[str, int], list[WriteRecord]] = {}
    for write in world.push.records.writes:
        by_lease.setdefault((write.req_id, write.rank), []).append(write)
    return by_lease


def _seen_at(world: World, write: WriteRecord) -> float | None:
    """The P step that had to see ``write`` done: the first one at or after its completion (P's clock). Exact,
    no EPS: events are ordered by their exact instants, so a WRITE done a nanosecond after a step waits for
    the next one."""
    if write.done_true is None or write.outcome == "p_dead":
        return None
    steps = world.p_steps_local
    i = bisect.bisect_left(steps, world.config.p_clock.local(write.done_true))
    return steps[i] if i < len(steps) else None


def push_bounded_reclaim(world: World) -> list[str]:
    """Invariant 1 for push: every lease, released or not, has ended by the first P step at or after
    ``max(grant + L, last processed heartbeat + E)`` (a WRITE never holds P's blocks past the bound)."""
    L, E = world.p_timing.lease_duration_s, world.p_timing.extension_s
    violations = []
    for lease in world.leases.values():
        point = lease.granted_local + L
        if lease.hb_processed_local:
            point = max(point, max(lease.hb_processed_local) + E)
        step = _first_step(world, point + 2 * EPS)
        if step is None:
            continue
        if lease.end_local is None:
            violations.append(f"{lease.req_id}@r{lease.rank}: still pinned after the step at {step:.3f} >= bound point {point:.3f}")
        elif lease.end_local > step + EPS:
            violations.append(f"{lease.req_id}@r{lease.rank}: ended at {lease.end_local:.3f} ({lease.outcome}), first step after "
                              f"bound point {point:.3f} was {step:.3f}")
    return violations


def released_only_by_write(world: World) -> list[str]:
    """P frees a lease whose WRITE completed through that WRITE: released at the first P step at or after the
    WRITE's completion (unless the lease had already expired by that step: a late write). A lease is never
    released any other way (no release on a read completion, none without a completed WRITE)."""
    violations = []
    writes = _writes(world)
    for key, lease in world.leases.items():
        seen = [s for w in writes.get(key, []) if w.outcome == "landed" and (s := _seen_at(world, w)) is not None]
        first = min(seen, default=None)
        name = f"{lease.req_id}@r{lease.rank}"
        if first is not None and (lease.end_local is None or lease.end_local > first + EPS):
            violations.append(f"{name}: its WRITE was done by the step at {first:.3f} but the lease was not released "
                              f"there (ended {lease.end_local}, {lease.outcome})")
        elif lease.outcome is Outcome.RELEASED:
            if first is None:
                violations.append(f"{name}: released at {lease.end_local:.3f} with no completed WRITE")
            elif abs(lease.end_local - first) > EPS:
                violations.append(f"{name}: released at {lease.end_local:.3f}, its WRITE was seen at {first:.3f}")
    return violations


def one_write_per_lease(world: World) -> list[str]:
    """P acts on one registration per lease: at most one WRITE per lease and P rank."""
    return [f"{req}@r{rank}: {len(ws)} WRITEs issued" for (req, rank), ws in _writes(world).items() if len(ws) > 1]


def writes_only_for_live_leases(world: World) -> list[str]:
    """A WRITE is issued only for a lease granted and not yet ended at that instant."""
    violations = []
    for write in world.push.records.writes:
        lease: LeaseRecord | None = world.leases.get((write.req_id, write.rank))
        if lease is None or lease.granted_true > write.issued_true or (
                lease.end_true is not None and lease.end_true < write.issued_true):
            violations.append(f"{write.req_id}@r{write.rank}: WRITE issued at t={write.issued_true:.3f} for a lease "
                              f"not live then")
    return violations


def late_writes_recorded(world: World) -> list[str]:
    """Late writes are exactly the landed WRITEs whose lease had ended by the P step that saw them done, and
    each is recorded; a WRITE that read freed or reused P blocks is one of them; a late WRITE that read intact
    blocks completed before the reap and was seen in the reaping step itself (P stalled between the two)."""
    violations = []
    recorded = {id(w) for w in world.push.records.late_writes}
    for write in world.push.records.writes:
        seen = _seen_at(world, write)
        if write.outcome != "landed" or seen is None:
            continue
        lease = world.leases[(write.req_id, write.rank)]
        late = lease.end_local is not None and (lease.end_local < seen - EPS or (
            lease.end_local <= seen + EPS and lease.outcome is not Outcome.RELEASED))
        name = f"{write.req_id}@r{write.rank}"
        if late != (id(write) in recorded):
            violations.append(f"{name}: WRITE seen at {seen:.3f}, lease ended {lease.end_local} ({lease.outcome}): "
                              f"late={late} but recorded={id(write) in recorded}")
        if write.source != "ok" and not late:
            violations.append(f"{name}: WRITE read {write.source} P blocks and is not a late write")
        if late and write.source == "ok" and abs(lease.end_local - seen) > EPS:
            violations.append(f"{name}: late WRITE with intact blocks seen at {seen:.3f}, not in the reaping step "
                              f"{lease.end_local:.3f}")
    return violations


def push_conservation(world: World) -> list[str]:
    """Invariant 8 for push, once quiet: every lease ended, no P block pinned, no block of the live D engine
    pinned (served requests freed after decoding, abandoned ones at once)."""
    violations = [f"{l.req_id}@r{l.rank}: lease never ended" for l in world.leases.values() if l.end_true is None]
    violations += inv.conservation(world)
    if world.d_alive:
        pinned = world.push_d.pool(world.d_generation).pinned
        if pinned:
            violations.append(f"D engine {world.d_engine}: {pinned} block(s) still pinned")
    return violations


def no_late_writes(world: World) -> list[str]:
    """No WRITE completes after its lease ended (healthy runs)."""
    return [f"{w.req_id}@r{w.rank}: late WRITE issued t={w.issued_true:.3f} done t={w.done_true:.3f} (source "
            f"{w.source})" for w in world.push.records.late_writes]


def no_reused_d_writes(world: World) -> list[str]:
    """No WRITE lands in D blocks another request owns (D gave up on its request and reused the blocks)."""
    return [f"{w.req_id}@r{w.rank}: WRITE landed at t={w.done_true:.3f} in reused D blocks"
            for w in world.push.records.reused_d_writes]


def push_data_intact(world: World) -> list[str]:
    """No request is served from a WRITE that read freed or reused P blocks (D cannot tell: flagged here)."""
    return [f"{r.spec.req_id}: served from WRITEs that read {sorted(set(r.push_sources) - {'ok'})} P blocks"
            for r in world.requests.values() if r.d_outcome == "served" and set(r.push_sources) - {"ok"}]


ALWAYS = {
    "push_bounded_reclaim": push_bounded_reclaim,
    "no_premature_reclaim": inv.no_premature_reclaim,
    "reaper_complete": inv.reaper_complete,
    "idempotent_release": inv.idempotent_release,
    "released_only_by_write": released_only_by_write,
    "one_write_per_lease": one_write_per_lease,
    "writes_only_for_live_leases": writes_only_for_live_leases,
    "late_writes_recorded": late_writes_recorded,
}
"""Push invariants that hold under every fault."""

HEALTHY = {
    "no_late_writes": no_late_writes,
    "no_reused_d_writes": no_reused_d_writes,
    "push_data_intact": push_data_intact,
}
"""Push invariants that hold while D is alive, gives up on nothing and its heartbeats stay within the loss
budget (a D stall under ``E - H``), P stalls under ``E - H``, every request reaching D at least ``H`` (plus any
D stall) before its lease's end; WRITEs of any length (D heartbeats the lease until the WRITE lands)."""


def check_push(world: World, *, quiescent: bool = False, healthy: bool = False) -> dict[str, list[str]]:
    """Run :data:`ALWAYS` (plus :func:`push_conservation` when ``quiescent``, :data:`HEALTHY` when ``healthy``);
    only the failing ones. Raises ValueError: ``world`` is not a push world."""
    if world.push is None:
        raise ValueError("check_push needs a world with transfer_mode='push'")
    checks = dict(ALWAYS)
    if quiescent:
        checks["push_conservation"] = push_conservation
    if healthy:
        checks.update(HEALTHY)
    return {name: v for name, fn in checks.items() if (v := fn(world))}
