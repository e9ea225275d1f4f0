"""Hypothesis properties of push-mode leases (``transfer_mode="push"``, leasekit/sim/push.py) on random
requests and faults, and proof that each planted push mutant (tests/sim/mutants.py) is caught.

What is expected, precisely:

- Under any fault (D killed or restarted, D and P stalls, heartbeat and registration loss, duplicated
  registrations, stray read completions, D aborts and timeouts, slow WRITEs): every invariant of
  ``push_invariants.ALWAYS`` holds and, once quiet, conservation.
- A late write that read freed or reused P blocks (harmful: P freed at the expiry while the WRITE was in
  flight) needs D's heartbeats for that request to have stopped reaching P while the WRITE was in flight:
  so at least one of: heartbeat loss was on; a D stall of at least ``E - H - 0.5`` s; D gave up on the request
  (abort, timeout); the request reached D less than ``H + 0.5`` s (plus the D stall, if any) before its
  lease's end (D's first heartbeat for it may come after that end). A D kill alone never makes one: the WRITE to a dead D fails.
- A late write that read intact blocks (benign: the WRITE finished before the reap, P saw it only in the
  reaping step) needs one of those, or a P stall of at least ``E - H - 0.5`` s.
- A WRITE lands in a reused D slot only for a request D gave up on before it landed.
- Healthy runs (D alive, no abort, heartbeat loss within the loss budget or a D stall under ``E - H``, P stalls
  under ``E - H``, every request reaching D ``H`` + stall before its lease's end, WRITEs of any length up to
  ``2 L``, duplicated registrations and stray completions allowed): ``push_invariants.HEALTHY`` holds too (no
  late write, no WRITE into a reused D slot, no request served from freed blocks), every request is served
  and every lease that got a registration is released by its WRITE.
- With P's production rules (``PLeaseKeeping``) in place of the sim's table: every invariant of ``ALWAYS`` and
  conservation, less one known gap of those rules, excluded exactly (:func:`sibling_rank_expiries`): with D TP >
  P TP a lease bound to one D rank expires while a sibling D rank's heartbeats arrive.
"""

import dataclasses

from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from leasekit.lease import LeaseTiming, loss_budget
from leasekit.lease.bounds import safe_stall_s
from leasekit.lease.codec import Heartbeat, decode_notification
from leasekit.lease.pkeeping import PLeaseKeeping
from leasekit.lease.table import Outcome, PLeaseTable
from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim import invariants as inv
from leasekit.sim import push_invariants as pinv
from leasekit.sim.bus import Action, drop_fraction
from leasekit.sim.push import PushP

from .mutants import (NoFreeAtExpiryPush, ReleaseOnCompletionPush, ReleaseOnLateWritePush, RepeatRegistrationPush,
                      WriteAfterExpiryPush)

SETTINGS = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SLACK_S = 0.5
"""Seconds of tick and latency slack in the cause bounds (P tick <= 0.3, D tick <= 0.1, latency <= 0.01)."""


@st.composite
def push_scenarios(draw, *, healthy: bool = False):
    """A random push world: lease length, ticks, TP sizes, WRITE length, requests, D admission, and faults
    (all of them unless ``healthy``: then only those the module docstring allows)."""
    L = draw(st.sampled_from([6, 12]))
    timing = LeaseTiming.from_lease_duration(L)
    H, E = timing.heartbeat_interval_s, timing.extension_s
    p_tp, d_tp = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]))
    config = WorldConfig(
        transfer_mode="push", lease_duration_s=L, p_tp=p_tp, d_tp=d_tp,
        p_tick_s=draw(st.sampled_from([0.1, 0.3])),
        d_tick_s=draw(st.sampled_from([0.05, 0.1])),
        latency_s=draw(st.floats(0.0, 0.01)),
        admit_every_s=draw(st.sampled_from([0.0, 1.0, 3.0])),
        max_running=draw(st.sampled_from([1, 3, 1 << 10])),
        write_s=draw(st.sampled_from([0.01, 0.5, L / 2])),
        push_timeout_s=4.0 * L if healthy else draw(st.sampled_from([1.5 * L, 3.0 * L])),
        seed=draw(st.integers(0, 2**16)),
    )
    faults: dict = {"dup_regs": draw(st.booleans())}
    if healthy:
        kind = draw(st.sampled_from(["none", "loss", "d_stall", "p_stall"]))
        stall = draw(st.floats(0.0, safe_stall_s(timing) - 1.0))
        if kind == "loss":
            faults["budget_loss"] = loss_budget(timing)
        elif kind in ("d_stall", "p_stall"):
            faults[kind] = (draw(st.floats(0, 30)), stall)
        first_hb = H * (loss_budget(timing) + 1) if kind == "loss" else H + (stall if kind == "d_stall" else 0.0)
        max_route = max(0.0, L - first_hb - 1.0)
    else:
        faults.update({
            "hb_loss": draw(st.sampled_from([0.0, 0.3, 0.8])),
            "reg_loss": draw(st.sampled_from([0.0, 0.5])),
            "d_stall": draw(st.none() | st.tuples(st.floats(0, 30), st.floats(0, 2.0 * L))),
            "p_stall": draw(st.none() | st.tuples(st.floats(0, 30), st.floats(0, L))),
            "d_kill": draw(st.none() | st.floats(0, 40)),
            "d_restart_after": draw(st.none() | st.floats(1, 20)),
        })
        max_route = 2.0 * L
    n = draw(st.integers(1, 6))
    requests = [
        RequestSpec(
            f"R{i}",
            prefill_end_s=draw(st.floats(0.0, 20.0)),
            blocks=draw(st.integers(1, 8)),
            route_delay_s=draw(st.floats(0.0, max_route)) if healthy else draw(st.none() | st.floats(0.0, max_route)),
            prefix_hit=draw(st.sampled_from([False, False, False, True])),
            write_s=draw(st.sampled_from([None, 2.0 * L])),
            stray_completion=draw(st.booleans()),
            d_abort_at_s=None if healthy else draw(st.none() | st.floats(0.0, 40.0)),
        )
        for i in range(n)
    ]
    return config, requests, faults


def _budget_loss_rule(budget: int):
    """Drop heartbeat batches in runs of ``budget``, one delivered after each run (the loss budget exactly)."""
    batches: list[float] = []

    def rule(msg, rng):
        if msg.kind != "heartbeat":
            return None
        if msg.sent_at_s not in batches:
            batches.append(msg.sent_at_s)
        return Action(drop=True) if batches.index(msg.sent_at_s) % (budget + 1) != budget else None
    return rule


def horizon(scenario) -> float:
    """A true time by which every bound has passed (the world is quiet)."""
    config, requests, faults = scenario
    L = config.lease_duration_s
    waves = -(-len(requests) // config.max_running)  # requests D holds one after another
    per_wave = config.push_timeout_s + 2.0 * L + config.admit_every_s + 1.0
    stalls = sum((faults.get(k) or (0, 0))[1] for k in ("d_stall", "p_stall"))
    return 20 + 2 * L + stalls + waves * per_wave + 3 * L + config.decode_s + 10


def build_push(scenario, push_factory=PushP, table_factory=PLeaseTable, world_class=World) -> World:
    config, requests, faults = scenario
    w = world_class(dataclasses.replace(config), table_factory=table_factory, push_factory=push_factory)
    for spec in requests:
        w.add(RequestSpec(**spec.__dict__))
    if faults.get("dup_regs"):
        w.bus.rules.append(lambda m, rng: Action(copies=2) if m.kind == "push_reg" else None)
    if faults.get("hb_loss"):
        w.bus.rules.append(drop_fraction("heartbeat", faults["hb_loss"]))
    if faults.get("reg_loss"):
        w.bus.rules.append(drop_fraction("push_reg", faults["reg_loss"]))
    if faults.get("budget_loss"):
        w.bus.rules.append(_budget_loss_rule(faults["budget_loss"]))
    if faults.get("d_stall"):
        w.stall_d(*faults["d_stall"])
    if faults.get("p_stall"):
        w.stall_p(*faults["p_stall"])
    if faults.get("d_kill") is not None:
        w.kill_d(faults["d_kill"])
        if faults.get("d_restart_after") is not None:
            w.restart_d(faults["d_kill"] + faults["d_restart_after"])
    return w.run(horizon(scenario))


def late_write_causes(w: World, faults: dict, write) -> set[str]:
    """The faults of the run that can have stopped D's heartbeats for ``write``'s request (module docstring)."""
    timing = w.config.timing()
    long_stall = safe_stall_s(timing) - SLACK_S
    record = w.requests[write.req_id]
    causes = set()
    if faults.get("hb_loss"):
        causes.add("hb_loss")
    if faults.get("d_stall") and faults["d_stall"][1] >= long_stall:
        causes.add("d_stall")
    if record.d_outcome in ("aborted", "timed_out"):
        causes.add("d_gave_up")
    d_stalled = faults["d_stall"][1] if faults.get("d_stall") else 0.0
    first_hb = timing.heartbeat_interval_s + d_stalled + SLACK_S  # latest, after the enqueue
    if record.enqueued_true is not None and record.enqueued_true + first_hb > record.granted_true + timing.lease_duration_s:
        causes.add("late_route")
    if write.source == "ok" and faults.get("p_stall") and faults["p_stall"][1] >= long_stall:
        causes.add("p_stall")
    return causes


@SETTINGS
@given(push_scenarios())
def test_push_invariants_hold_under_random_faults_and_each_violation_has_its_cause(scenario):
    w = build_push(scenario)
    assert pinv.check_push(w, quiescent=True) == {}
    faults = scenario[2]
    for write in w.push.records.late_writes:
        assert late_write_causes(w, faults, write), f"late write of {write} without a cause"
    for write in w.push.records.reused_d_writes:
        record = w.requests[write.req_id]
        assert record.d_outcome in ("aborted", "timed_out") and record.d_outcome_true <= write.done_true
    harmful = {x.req_id for x in w.push.records.late_writes if x.source != "ok"}
    assert {r.spec.req_id for r in w.requests.values() if r.d_outcome == "served" and set(r.push_sources) - {"ok"}} <= harmful


@SETTINGS
@given(push_scenarios(healthy=True))
def test_a_healthy_push_world_has_no_late_write_and_releases_every_lease_by_its_write(scenario):
    w = build_push(scenario)
    assert pinv.check_push(w, quiescent=True, healthy=True) == {}
    assert all(r.d_outcome == "served" for r in w.requests.values())
    registered = {r.spec.req_id for r in w.requests.values() if r.registered_true is not None}
    for (req_id, _rank), lease in w.leases.items():
        if req_id in registered:
            assert lease.outcome is Outcome.RELEASED
    assert set(w.push.records.reg_drops) <= {"push_reg_repeat"}


def keeping_factory(timing):
    """P's rules as LeaseKit's production worker applies them (leasekit.lease.pkeeping.PLeaseKeeping)."""
    return PLeaseKeeping(timing, max_hold_s=max(480.0, timing.lease_duration_s))


class SenderWorld(World):
    """A world that also notes the sender (D agent ``D<generation>-r<D rank>``) of each heartbeat arrival it
    records: ``hb_senders[(req id, P rank)]`` runs parallel to that lease's ``hb_arrivals_true`` (same condition:
    the lease granted and not ended when the heartbeat arrived)."""

    def __init__(self, *args, **kwargs):
        self.hb_senders: dict[tuple[str, int], list[str]] = {}
        super().__init__(*args, **kwargs)

    def _note_arrival(self, rank, msg, t):
        if msg.kind == "heartbeat":
            result = decode_notification(msg.payload)
            if isinstance(result, Heartbeat):
                for req_id in result.req_ids:
                    lease = self.leases.get((req_id, rank))
                    if lease is not None and lease.end_true is None:
                        self.hb_senders.setdefault((req_id, rank), []).append(msg.src)
        super()._note_arrival(rank, msg, t)


def sibling_rank_expiries(w: SenderWorld) -> set[str]:
    """The expired leases (``"<req id>@r<P rank>"``) of P's known gap: P's production rules bind a plain lease to
    the first D agent whose heartbeat names it (leasekit/lease/binding.py) and count a sibling D TP rank's
    heartbeats (D TP > P TP) as foreign, so the lease may expire while that sibling's heartbeats arrive
    (tests/unit/test_pkeeping.py::test_a_delivered_heartbeat_of_a_sibling_d_rank_keeps_the_lease_alive, strict
    xfail). Exactly those leases: invariant 2 holds for them when only the bound agent's heartbeats are counted,
    and every arrival that would have kept the lease came from another rank of the bound agent's D engine."""
    E, L = w.p_timing.extension_s, w.p_timing.lease_duration_s
    clock, found = w.config.p_clock, set()
    for key, lease in w.leases.items():
        senders = w.hb_senders.get(key, [])
        if lease.outcome is not Outcome.EXPIRED or not senders:
            continue
        assert len(senders) == len(lease.hb_arrivals_true), "SenderWorld out of step with World._note_arrival"
        arrived = [(clock.local(a), src) for a, src in zip(lease.hb_arrivals_true, senders) if a <= lease.end_true + inv.EPS]
        if not arrived:
            continue
        bound = senders[0]  # first contact: the first heartbeat drained for the lease binds it
        engine = bound.rsplit("-r", 1)[0]
        by_bound = max([lease.granted_local + L] + [a + E for a, src in arrived if src == bound])
        keeping = [src for a, src in arrived if lease.end_local < a + E - inv.EPS]
        if lease.end_local >= by_bound - inv.EPS and keeping and all(
                src != bound and src.rsplit("-r", 1)[0] == engine for src in keeping):
            found.add(f"{lease.req_id}@r{lease.rank}")
    return found


def check_with_production_rules(scenario) -> tuple[dict, set[str]]:
    """Every push invariant over ``scenario`` run with P's production rules, less the no-premature-reclaim
    violations of the known sibling-rank gap (:func:`sibling_rank_expiries`, returned second)."""
    w = build_push(scenario, table_factory=keeping_factory, world_class=SenderWorld)
    found = pinv.check_push(w, quiescent=True)
    gap = sibling_rank_expiries(w)
    premature = [v for v in found.pop("no_premature_reclaim", []) if v.split(":", 1)[0] not in gap]
    if premature:
        found["no_premature_reclaim"] = premature
    return found, gap


@settings(SETTINGS, max_examples=20)
@given(push_scenarios())
def test_push_invariants_hold_with_ps_production_rules(scenario):
    # Excluded: P's known sibling-rank gap (sibling_rank_expiries; tests/unit/test_pkeeping.py::
    # test_a_delivered_heartbeat_of_a_sibling_d_rank_keeps_the_lease_alive), nothing else.
    assert check_with_production_rules(scenario)[0] == {}


def test_the_sibling_rank_gap_is_excluded_exactly():
    """The falsifying example of the gap (D TP 2 > P TP 1, heartbeat loss): with the sim's reference table every
    invariant holds; with P's production rules the only violation is R1's expiry while D rank 1's heartbeats
    arrived, and it is the gap's (its bound rank 0's last heartbeat came at 7.15 s, rank 1's at 8.15 s)."""
    config = WorldConfig(transfer_mode="push", lease_duration_s=6, p_tick_s=0.1, d_tick_s=0.05, p_tp=1, d_tp=2,
                         latency_s=0.0, max_running=1, decode_s=0.5, write_s=0.01, push_timeout_s=9.0, seed=1)
    requests = [RequestSpec(f"R{i}", prefill_end_s=0.0, blocks=1, route_delay_s=0.0) for i in range(2)]
    scenario = (config, requests, {"dup_regs": False, "hb_loss": 0.3, "reg_loss": 0.5})
    assert pinv.check_push(build_push(scenario), quiescent=True) == {}
    w = build_push(scenario, table_factory=keeping_factory, world_class=SenderWorld)
    assert pinv.check_push(w, quiescent=True) == {"no_premature_reclaim": ["R1@r0: expired at 11.200 before 12.150"]}
    assert sibling_rank_expiries(w) == {"R1@r0"} and check_with_production_rules(scenario) == ({}, {"R1@r0"})
    # the same world with D rank 1 as a stranger (another engine's agent) is not excused
    w.hb_senders[("R1", 0)] = [s.replace("D0-r1", "D9-r1") for s in w.hb_senders[("R1", 0)]]
    assert sibling_rank_expiries(w) == set()


def always(w: World) -> dict:
    return pinv.check_push(w, quiescent=True)


def caught(push_factory, wanted: set[str], healthy=False):
    """Search for a scenario where the mutant breaks every invariant in ``wanted``; returns the broken ones.
    The search looks for ``wanted`` itself, not for any violation: Hypothesis draws constants from the local
    modules already imported, so a derandomized search still draws other scenarios when other tests ran before
    it, and the first scenario that breaks some other invariant need not break ``wanted``."""
    def breaks(sc) -> bool:
        return wanted <= set(always(build_push(sc, push_factory)))

    example = find(
        push_scenarios(healthy=healthy),
        breaks,
        # no shrinking, derandomized: the same search every run (see tests/sim/test_properties.py)
        settings=settings(max_examples=500, deadline=None, database=None, phases=[Phase.generate],
                          derandomize=True, suppress_health_check=list(HealthCheck)),
    )
    return always(build_push(example, push_factory))


def test_mutant_release_on_read_completion_is_caught():
    assert "released_only_by_write" in caught(ReleaseOnCompletionPush, {"released_only_by_write"}, healthy=True)


def test_mutant_acting_on_a_repeated_registration_is_caught():
    assert "one_write_per_lease" in caught(RepeatRegistrationPush, {"one_write_per_lease"}, healthy=True)


def test_mutant_not_freeing_at_expiry_while_the_write_is_in_flight_is_caught():
    assert "push_bounded_reclaim" in caught(NoFreeAtExpiryPush, {"push_bounded_reclaim"})


def test_mutant_write_completion_ignoring_the_expiry_is_caught():
    found = caught(ReleaseOnLateWritePush, {"idempotent_release", "late_writes_recorded"})
    assert "idempotent_release" in found and "late_writes_recorded" in found


def test_mutant_write_for_an_expired_lease_is_caught():
    assert "writes_only_for_live_leases" in caught(WriteAfterExpiryPush, {"writes_only_for_live_leases"})
