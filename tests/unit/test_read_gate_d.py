"""D's read gate: a protected read waits for P's verdict or an acked heartbeat, else fails closed; its settings."""

import pytest

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.checks import check_fail_closed
from leasekit.lease.readgate import FAIL as GATE_FAIL
from leasekit.lease.readgate import (
    DISCARDED_OUTCOMES,
    HOLD,
    OUTCOME_ABANDONED,
    OUTCOME_REAPED,
    OUTCOME_TIMEOUT,
    OUTCOME_UNGATED,
    OUTCOME_VERIFIED,
    RELEASED_OUTCOMES,
    USE,
    ReadGate,
)
from tests.unit.test_checks import lease


def gate(timeout_s=6.0, max_remaining_s=6.0):
    g = ReadGate(timeout_s, max_remaining_s=max_remaining_s, clock=lambda: 0.0)
    g.protect("d1")
    g.expect("d1", "p0", "P1", now=0.0)
    return g


def test_unprotected_reads_are_used_as_stock_does():
    g = ReadGate(6.0)
    g.expect("d1", "p0", "P1")
    assert g.hold("d1", now=0.0) == USE


def test_a_protected_read_waits_for_every_agent_that_served_it():
    g = gate()
    g.expect("d1", "p1", "P1", now=0.0)
    assert g.hold("d1", now=1.0) == HOLD
    g.verdict("p0", "P1", True)
    assert g.resolve(now=1.1) == []
    g.verdict("p1", "P1", True)
    (result,) = g.resolve(now=1.2)
    assert (result.outcome, result.request_id, result.remote_request_id) == (OUTCOME_VERIFIED, "d1", "P1")
    assert result.wait_s == pytest.approx(0.2)
    assert g.held == 0 and not g.is_protected("d1")


def test_one_reaped_answer_discards_the_read_and_cannot_be_overwritten():
    g = gate()
    g.verdict("p0", "P1", False)  # may arrive before D polls the transfer
    g.verdict("p0", "P1", True)
    assert g.hold("d1", now=1.0) == HOLD
    (result,) = g.resolve(now=1.0)
    assert result.outcome == OUTCOME_REAPED


def test_no_answer_times_out_and_a_verdict_from_another_agent_does_not_count():
    g = gate(timeout_s=2.0)
    assert g.hold("d1", now=1.0) == HOLD
    g.verdict("forger", "P1", True)
    assert g.resolve(now=2.9) == []
    (result,) = g.resolve(now=3.0)
    assert result.outcome == OUTCOME_TIMEOUT and result.wait_s == pytest.approx(2.0)


def test_a_protected_read_nobody_was_asked_about_fails_closed():
    g = ReadGate(6.0, clock=lambda: 0.0)
    g.protect("d1")  # the hook failed before expect(): no P agent will answer
    assert g.hold("d1") == GATE_FAIL
    assert [r.outcome for r in g.resolve()] == [OUTCOME_UNGATED]


def test_protection_lasts_until_the_request_finishes_however_long_it_waits():
    g = gate()
    g.protect("d2")
    assert g.hold("d1", now=10_000.0) == HOLD  # no age limit: a read after hours is still gated
    g.finish("d2")
    assert not g.is_protected("d2")
    assert g.resolve(now=10_000.0) == []  # still waiting for P
    g.finish("d1")  # the request finished on D (aborted) while its read was held
    assert not g.is_protected("d1")
    (result,) = g.resolve(now=10_001.0)  # reported, so that vLLM frees its blocks; nothing is left
    assert result.request_id == "d1" and result.outcome == OUTCOME_ABANDONED
    assert OUTCOME_ABANDONED in RELEASED_OUTCOMES and OUTCOME_ABANDONED not in DISCARDED_OUTCOMES
    assert g._reads == {} and g.resolve(now=20_000.0) == []


def test_a_read_still_in_flight_when_its_request_finished_is_abandoned_not_unprotected():
    g = gate()
    g.finish("d1")  # protected by gate(); the read has not finished yet
    assert g.hold("d1", now=1.0) == USE  # used as stock: the request produces no more tokens
    assert g.pop_finished("d1") and not g.pop_finished("d1")
    g.finish("never-protected")
    assert not g.pop_finished("never-protected")
    g.protect("d3")  # protected, but its read was never posted (a full local prefix hit): nothing kept
    g.finish("d3")
    assert g._finished == {} and not g.pop_finished("d3")


def test_a_second_read_of_the_same_p_request_is_not_verified_by_the_first_ones_verdict():
    g = gate()
    g.protect("d2")
    g.expect("d2", "p0", "P1", now=0.0)  # concurrent: the key belongs to d1
    g.verdict("p0", "P1", True)
    assert g.hold("d1", now=0.5) == HOLD and g.hold("d2", now=0.5) == GATE_FAIL
    assert sorted((r.request_id, r.outcome) for r in g.resolve(now=0.5)) == [
        ("d1", OUTCOME_VERIFIED), ("d2", OUTCOME_UNGATED)]
    g.protect("d3")  # a retry soon after: a stale verdict of d1's read could still arrive
    g.expect("d3", "p0", "P1", now=1.0)
    g.verdict("p0", "P1", True)
    assert g.hold("d3", now=1.0) == GATE_FAIL
    g.protect("d4")  # long after: still ungated (P freed P1 at the first completion; a verdict queued
    g.expect("d4", "p0", "P1", now=1e6)  # for d1's read may arrive at any time over ZMQ)
    g.verdict("p0", "P1", True)
    assert g.hold("d4", now=1e6) == GATE_FAIL


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        ReadGate(0)


def test_fail_closed_accepts_a_discarded_read_only_with_matching_tokens():
    expired = [lease("a", end=6.0), lease("b", end=6.0), lease("c", end=6.0), lease("d", end=6.0)]
    served = {rid: 130.0 for rid in "abcd"}  # all after expiry (grant 100 + 6)
    result = check_fail_closed(expired, served, {}, {"a": "timeout", "b": "reaped", "c": "timeout"},
                               {"a": True, "b": False, "c": None})
    verdicts = {row.request_id: row.verdict for row in result.rows}
    assert verdicts == {"a": PASS, "b": FAIL, "c": UNKNOWN, "d": FAIL}
    assert result.verdict == FAIL
    ok = check_fail_closed(expired[:1], served, {}, {"a": "reaped"}, {"a": True})
    assert ok.verdict == PASS and "1 recomputed" in ok.summary


def test_acknowledged_heartbeats_let_a_read_through_without_waiting():
    g = gate()
    seq = g.heartbeat_sent("p0", now=1.0)
    g.ack("p0", seq, 4.0, ["P1"])  # held until at least 1 + 4 / K = 4.27 on D's clock (K = 1.1 / 0.9)
    assert g.hold("d1", now=4.2) == HOLD
    (result,) = g.resolve(now=4.2)
    assert result.outcome == OUTCOME_VERIFIED and result.wait_s == 0.0
    g.verdict("p0", "P1", True)  # P's verdict still arrives; nothing keeps it
    assert g._reads == {}


def test_a_read_seen_after_the_horizon_waits_for_the_verdict():
    g = gate()
    g.ack("p0", g.heartbeat_sent("p0", now=1.0), 4.0, ["P1"])
    assert g.hold("d1", now=4.3) == HOLD  # past 1 + 4 / K: P's clock may have run 10 % fast, D's 10 % slow
    assert g.resolve(now=4.3) == []


def test_an_ack_claims_at_most_the_lease_duration():
    g = gate(max_remaining_s=6.0)
    g.ack("p0", g.heartbeat_sent("p0", now=1.0), 1e9, ["P1"])  # forged or broken: cut to 1 + 6 = 7
    assert g.hold("d1", now=7.5) == HOLD
    assert g.resolve(now=7.5) == []


def test_acks_match_their_own_send_whatever_was_lost():
    g = gate()
    g.heartbeat_sent("p0", now=1.0)  # lost: never acknowledged
    g.ack("p0", g.heartbeat_sent("p0", now=2.0), 4.0, ["P1"])  # horizon 2 + 4 / K = 5.27 (from 1: 4.27)
    assert g.hold("d1", now=5.0) == HOLD
    assert [r.outcome for r in g.resolve(now=5.0)] == [OUTCOME_VERIFIED]


def test_unknown_or_repeated_acks_are_ignored():
    g = gate()
    seq = g.heartbeat_sent("p0", now=1.0)
    g.ack("p0", seq + 7, 100.0, ["P1"])  # no such send
    g.ack("forger", seq, 100.0, ["P1"])  # not that agent's send
    assert g.hold("d1", now=10.0) == HOLD
    assert g.resolve(now=10.0) == []
    g.ack("p0", seq, 4.0, ["P1"])
    g.ack("p0", seq, 100.0, ["P1"])  # a replay: the send was consumed
    assert g.resolve(now=10.0) == []


def test_fail_closed_is_on_by_default_and_a_bad_value_is_refused_with_the_fix():
    from leasekit.lease.settings import ReadGateConfigError, fail_closed_enabled, verdict_timeout

    assert fail_closed_enabled({}) is True
    assert fail_closed_enabled({"leasekit_fail_closed": False}) is False
    with pytest.raises(ReadGateConfigError, match="leasekit_fail_closed.*true or false"):
        fail_closed_enabled({"leasekit_fail_closed": "yes"})
    assert verdict_timeout({}, 900.0) == 600.0  # a long lease still starts: default min(L, 600)
    assert verdict_timeout({}, 0.01) == 0.05  # a tiny L (linted elsewhere) still starts: clamped default
    with pytest.raises(ReadGateConfigError, match=r"\[0.05, 86400\]"):
        verdict_timeout({"leasekit_verdict_timeout_s": 0}, 6.0)
