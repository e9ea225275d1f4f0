"""P-side proof that a stall or dropped heartbeats really silenced D (pure logic over evidence)."""

from types import SimpleNamespace

import pytest

from leasekit.chaos.execute import ScenarioExecution
from leasekit.chaos.scenario import find_scenario


def lease(beats, outcome="released", end=100.0, grant=0.0):
    return SimpleNamespace(heartbeats_s=tuple(beats), outcome=outcome, end_s=end, grant_s=grant)


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


def test_silence_until_a_release_after_the_interval_counts(execution):
    """A push writer stall: P heard the last heartbeat just before it, and the WRITEs it held landed as it
    ended, releasing the leases with no heartbeat after: the gap runs to the first release."""
    stall = [(4.4, 10.4, 0.0, 5.4, "push writer stall of 6 s on P")]
    (e,) = effects(execution, stall, [lease([0.1, 1.1, 2.1, 3.2, 4.2], end=10.43), lease([1.0, 2.1, 4.1], end=10.41)])
    assert e.took_effect and "release" in e.evidence and "6.210 s" in e.evidence and "at least 5.400 s" in e.evidence
    (early,) = effects(execution, stall, [lease([0.1, 1.1, 2.1, 3.2, 4.2], end=9.0)])  # released well inside it
    assert not early.took_effect and "4.800 s" in early.evidence
    (edge,) = effects(execution, stall, [lease([0.1, 1.1, 2.1, 3.2, 4.2], end=10.399)])  # clocks a ms apart
    assert edge.took_effect and "6.199 s" in edge.evidence
    (first,) = effects(execution, stall, [lease([0.1, 4.2], end=30.0, grant=11.0)])  # granted after the stall
    assert not first.took_effect and "no heartbeat, expiry or release" in first.evidence
    (heard,) = effects(execution, stall, [lease([3.2, 4.2, 8.0], end=10.43)])  # a heartbeat in the stall still shows
    assert not heard.took_effect and "heartbeat" in heard.evidence and "3.800 s" in heard.evidence


def test_no_heartbeat_before_the_fault_is_not_evidence(execution):
    (e,) = effects(execution, [(10.0, 12.0, 0.0, 1.8, "stall")], [lease([12.5, 13.5])])
    assert not e.took_effect and "before" in e.evidence


def test_a_partitions_silence_is_where_its_rules_surely_held(monkeypatch):
    """Each ``nft`` can take a good part of a second on a loaded host: the silence P must show is the
    interval between the adding command's return and the deleting command's start, not around them."""
    from leasekit.chaos.actions import FaultRun

    class SlowNft:
        record = {"injected_monotonic_s": 100.0, "injected_wall_s": 5000.0, "in_force_monotonic_s": 100.4,
                  "in_force_wall_s": 5000.4}

        def recover(self):
            self.record.update(packets_matched=1, lifting_monotonic_s=101.3, recovered_monotonic_s=101.7)

    run = FaultRun(SimpleNamespace(), [], [], SimpleNamespace())
    run._partitions = [(0.0, SlowNft(), True, "all both (drop)")]
    monkeypatch.setattr("leasekit.chaos.actions.time.monotonic", lambda: 101.8)
    run.finish_partition()
    ((start, end, wall, min_gap, label),) = run.silences
    assert (start, end, wall) == (100.4, 101.3, 5000.4) and min_gap == pytest.approx(0.81)
    assert run.windows[0][:2] == (100.0, 101.8)  # the fault's own window still spans both commands


def _steady(verdict, expiries, premature=0, outcome="expired"):
    from leasekit.chaos.checks import CheckResult, LeaseVerdict
    rows = [LeaseVerdict("A", verdict, "x", lease=SimpleNamespace(outcome=outcome))] if verdict == "FAIL" else []
    return CheckResult("steady-state", verdict, f"{expiries} expiries", rows,
                       {"expiries": expiries, "premature_expiries": premature,
                        "only_on_time_expiries": verdict == "FAIL" and not premature and outcome == "expired"})


@pytest.mark.parametrize("first, second, runs, verdict", [
    (_steady("FAIL", 4), _steady("PASS", 0), 2, "PASS"),  # a burst of host load: the second run decides
    (_steady("FAIL", 4), _steady("FAIL", 4), 2, "FAIL"),  # a pair that cannot keep its leases fails twice
    (_steady("FAIL", 4, premature=1), None, 1, "FAIL"),  # a premature expiry is a verdict at once
    (_steady("FAIL", 1, outcome="aborted"), None, 1, "FAIL"),
    (_steady("PASS", 0), None, 1, "PASS"),
])
def test_a_steady_state_with_only_on_time_expiries_runs_once_more(tmp_path, first, second, runs, verdict):
    ex = ScenarioExecution(find_scenario("kill-decode"), "leasekit", SimpleNamespace(run_dir=tmp_path, decode=SimpleNamespace(started_at=1.0)), tmp_path,
                           say=lambda *_: None)
    results = [first, second]
    ex._steady_run = lambda: results.pop(0)
    check = ex.steady_state()
    assert check.verdict == verdict and len(results) == 2 - runs
    assert (runs == 2) == any("steady state run twice" in n for n in ex.result.notes)
    assert ex.steady_state() is check  # cached for this D: the next scenario on the pair does not rerun it
    assert ("run twice there" in ex.result.notes[-1]) == (runs == 2)  # and its notes say the first run failed
