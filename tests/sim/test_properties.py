"""Hypothesis properties for invariants 1, 2, 3, 6 and 8 on random event sequences, and proof that
each planted mutant (tests/sim/mutants.py) is caught."""

from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from leasekit.lease import LeaseTiming
from leasekit.lease.pkeeping import PLeaseKeeping
from leasekit.lease.table import PLeaseTable
from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim import invariants as inv
from leasekit.sim.bus import Action, drop_fraction

from .mutants import HeadOnlyReapTable, NonIdempotentReleaseTable, ReapFirstTable

SETTINGS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw, *, healthy: bool = False):
    """A random P/D world: lease length, ticks, requests, D admission, and (unless ``healthy``)
    faults: heartbeat loss, duplicated and delayed notifications, D/P stalls, a D kill."""
    L = draw(st.sampled_from([6, 12, 30]))
    timing = LeaseTiming.from_lease_duration(L)
    config = WorldConfig(
        lease_duration_s=L,
        p_tick_s=draw(st.sampled_from([0.05, 0.1, 0.3])),
        d_tick_s=draw(st.sampled_from([0.05, 0.1])),
        latency_s=draw(st.floats(0.0, 0.01)),
        admit_every_s=draw(st.sampled_from([0.0, 1.0, 3.0])),
        max_running=draw(st.sampled_from([1, 4, 1 << 10])),
        seed=draw(st.integers(0, 2**16)),
    )
    n = draw(st.integers(1, 10))
    max_route = max(0.0, L - timing.heartbeat_interval_s - 1.0) if healthy else 2.0 * L
    requests = [
        RequestSpec(
            f"R{i}",
            prefill_end_s=draw(st.floats(0.0, 20.0)),
            blocks=draw(st.integers(1, 8)),
            route_delay_s=draw(st.floats(0.0, max_route)) if healthy else draw(st.none() | st.floats(0.0, max_route)),
            prefix_hit=draw(st.booleans()),
        )
        for i in range(n)
    ]
    faults = {}
    if not healthy:
        faults = {
            "hb_loss": draw(st.sampled_from([0.0, 0.3, 0.8])),
            "dup_completions": draw(st.booleans()),
            "late_completion_delay": draw(st.sampled_from([0.0, 0.5 * L, 2.0 * L])),
            "d_stall": draw(st.none() | st.tuples(st.floats(0, 30), st.floats(0, 2.0 * L))),
            "p_stall": draw(st.none() | st.tuples(st.floats(0, 30), st.floats(0, L))),
            "d_kill": draw(st.none() | st.floats(0, 40)),
        }
    return config, requests, faults


def build(scenario, table_factory=PLeaseTable, track_on="enqueue") -> World:
    config, requests, faults = scenario
    w = World(config, table_factory=table_factory, track_on=track_on)
    for spec in requests:
        w.add(RequestSpec(**spec.__dict__))
    if faults.get("hb_loss"):
        w.bus.rules.append(drop_fraction("heartbeat", faults["hb_loss"]))
    if faults.get("dup_completions"):
        w.bus.rules.append(lambda m, rng: Action(copies=2) if m.kind == "completion" else None)
    if faults.get("late_completion_delay"):
        delay = faults["late_completion_delay"]
        w.bus.rules.append(lambda m, rng: Action(delay_s=delay) if m.kind == "completion" and rng.random() < 0.5 else None)
    if faults.get("d_stall"):
        w.stall_d(*faults["d_stall"])
    if faults.get("p_stall"):
        w.stall_p(*faults["p_stall"])
    if faults.get("d_kill") is not None:
        w.kill_d(faults["d_kill"])
    horizon = 20 + 2 * config.lease_duration_s + len(requests) * (config.admit_every_s + 1) + 120 + 4 * config.lease_duration_s
    return w.run(horizon)


def violations(w: World) -> dict:
    found = inv.check_all(w, quiescent=True)
    found.pop("fail_closed", None)  # not one of this properties; asserted separately below
    return found


@SETTINGS
@given(scenarios())
def test_invariants_1_2_3_6_8_hold_under_random_faults(scenario):
    w = build(scenario)
    assert violations(w) == {}
    assert inv.fail_closed(w) == []


@SETTINGS
@given(scenarios(healthy=True))
def test_a_healthy_d_never_sees_a_lease_expire_before_its_read(scenario):
    w = build(scenario)
    assert inv.false_expiries(w) == []
    assert violations(w) == {}


def caught(table_factory=PLeaseTable, track_on="enqueue", healthy=False, check=violations):
    """Search for a scenario where the mutant breaks an invariant; returns the broken ones."""
    example = find(
        scenarios(healthy=healthy),
        lambda sc: bool(check(build(sc, table_factory, track_on))),
        # no shrinking: any counterexample proves the mutant is caught
        # derandomized: the same search every run, so a pass is repeatable, not luck
        settings=settings(max_examples=2000, deadline=None, database=None, phases=[Phase.generate],
                          derandomize=True, suppress_health_check=list(HealthCheck)),
    )
    return check(build(example, table_factory, track_on))


def test_mutant_reap_first_is_caught():
    assert "no_premature_reclaim" in caught(ReapFirstTable)


def test_mutant_head_only_reap_is_caught():
    found = caught(HeadOnlyReapTable)
    assert "reaper_complete" in found or "bounded_reclaim" in found


def test_mutant_heartbeat_from_scheduling_is_caught():
    found = caught(track_on="admit", healthy=True, check=lambda w: inv.false_expiries(w))
    assert found


def test_mutant_non_idempotent_release_is_caught():
    assert "idempotent_release" in caught(NonIdempotentReleaseTable)


def keeping_factory(timing):
    """P's rules as LeaseKit's production worker applies them (leasekit.lease.pkeeping.PLeaseKeeping)."""
    return PLeaseKeeping(timing, max_hold_s=max(480.0, timing.lease_duration_s))


class ReapFirstKeeping(PLeaseKeeping):
    """Mutant: reaps before it drains the step's notifications."""

    def step(self, now_s, notifications=()):
        ended = [*self.table.reap(now_s)]
        result = super().step(now_s, notifications)
        result.ended[:0] = ended
        return result


@SETTINGS
@given(scenarios())
def test_invariants_hold_with_ps_production_rules(scenario):
    """The same properties with P's lease keeping as the production worker runs it (binding to the first
    D agent, max hold, the expiry heap) in place of the reference table. The simulator makes no grant
    pledge (``pledge_s`` 0) and grants instantly (no completion before a grant): those rules are
    tests/unit/test_pkeeping.py's."""
    w = build(scenario, keeping_factory)
    assert violations(w) == {}
    assert inv.fail_closed(w) == []


def test_mutant_reap_first_of_the_production_rules_is_caught():
    assert "no_premature_reclaim" in caught(lambda timing: ReapFirstKeeping(timing, max_hold_s=480.0))
