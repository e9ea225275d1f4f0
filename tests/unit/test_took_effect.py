"""P-side proof that a stall or dropped heartbeats really silenced D (pure logic over evidence)."""

from types import SimpleNamespace

import pytest

from leasekit.chaos.execute import ScenarioExecution
from leasekit.chaos.scenario import find_scenario


def lease(beats, outcome="released", end=100.0):
    return SimpleNamespace(heartbeats_s=tuple(beats), outcome=outcome, end_s=end)


@pytest.fixture
def execution(tmp_path):
    ex = ScenarioExecution(find_scenario("stall-decode-short"), "leasekit", SimpleNamespace(), tmp_path)
    ex.reader.to_p_clock = lambda mono, wall: mono  # runner and P share the clock here
    return ex


def effects(ex, silences, leases):
    ex.fault_run = SimpleNamespace(silences=silences)
    return ex.silence_effects(SimpleNamespace(leases=leases))


def test_a_real_stall_shows_as_a_gap_in_ps_heartbeats(execution):
    (e,) = effects(execution, [(10.0, 12.0, 0.0, 1.8, "sigstop stall of 2 s on decode")],
                   [lease([8, 9, 9.9, 12.4, 13.4]), lease([9.05, 12.45])])
    assert e.took_effect and "2.500 s" in e.evidence


def test_a_stall_that_did_nothing_is_caught(execution):
    (e,) = effects(execution, [(10.0, 12.0, 0.0, 1.8, "sigstop stall of 2 s on decode")],
                   [lease([9, 10, 11, 12, 13])])
    assert not e.took_effect and "1.000 s" in e.evidence


def test_silence_until_an_expiry_counts_up_to_e(execution):
    """D frozen past E: no heartbeat after the freeze on these leases, they expired instead."""
    (e,) = effects(execution, [(10.0, 18.0, 0.0, 7.2, "freezer stall of 8 s on decode")],
                   [lease([8, 9, 9.5], outcome="expired", end=13.6)])
    assert e.took_effect and "expiry" in e.evidence


def test_no_heartbeat_before_the_fault_is_not_evidence(execution):
    (e,) = effects(execution, [(10.0, 12.0, 0.0, 1.8, "stall")], [lease([12.5, 13.5])])
    assert not e.took_effect and "before" in e.evidence
