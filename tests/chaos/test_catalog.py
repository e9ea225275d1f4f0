"""The whole chaos catalog as tests: every scenario on every target it lists, on real P/D pairs
shared across the session (the leasekit pytest plugin plans the order and owns the pairs).

Each case must end with its expected verdict; a PASS must come with evidence that every fault took
effect; an expected FAIL must name the invariant and the defect; UNKNOWN is expected only where the
fault cannot be injected on that target (the stock connector has no fault points)."""

import pytest

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.plugin import run_case

pytestmark = [pytest.mark.pair, pytest.mark.chaos]


def test_scenario_ends_with_its_expected_verdict(vllm_available, leasekit_suite, chaos_case):
    scenario, target = chaos_case
    result = run_case(leasekit_suite, scenario, target)
    steady = result.steady_state
    evidence = "\n".join([result.summary, *(f"{c.name}: {c.verdict} - {c.summary}" for c in result.checks),
                          *(f"steady state {r.request_id}: {r.verdict} - {r.reason}" for r in (steady.rows if steady else [])
                            if r.verdict != PASS),
                          *(f"effect {e.fault}: {e.took_effect} - {e.evidence}" for e in result.effects), *result.notes[-2:]])
    assert not result.summary.startswith("harness error"), evidence
    assert result.verdict == result.expected, evidence
    assert result.as_expected, evidence  # an expected FAIL fails exactly its failing_checks
    if result.verdict == PASS:
        assert result.checks and all(c.verdict == PASS for c in result.checks), evidence
        assert all(e.took_effect for e in result.effects), evidence
        faults = [f for f in scenario.faults if f.kind != "none"]
        assert len(result.effects) >= len(faults), evidence  # every fault showed evidence it took effect
    elif result.verdict == FAIL:
        assert result.known_defect and result.expected_failing, evidence
        assert all(c.rows or c.details for c in result.checks if c.verdict == FAIL), evidence
    else:
        assert result.verdict == UNKNOWN and "stock connector" in result.summary, evidence
