"""The checker's verdicts on synthetic lease timelines (pure logic: no pair needed)."""

import pytest

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.checks import check_bounded_reclaim, check_lease_reclaim, check_steady_state, on_time_only
from leasekit.chaos.endchecks import check_decode_conservation
from leasekit.cluster.router import DecodeResult
from leasekit.lease import LeaseTiming
from leasekit.telemetry.lease_timeline import LeaseTimeline

T6 = LeaseTiming.from_lease_duration(6)  # H=1, E=4


def lease(rid="R", *, outcome="expired", hbs=(1.0, 2.0), end=6.5, L=6.0, grant=100.0):
    hbs = tuple(grant + h for h in hbs)
    return LeaseTimeline(
        request_id=rid, engine_id="P", tp_rank=0, kv_blocks=1, lease_duration_s=L, extension_s=4.0,
        grant_s=grant, initial_deadline_s=grant + L, heartbeats_s=hbs, heartbeat_count=len(hbs),
        last_heartbeat_s=hbs[-1] if hbs else None, deadline_s=grant + end, end_s=grant + end,
        outcome=outcome, retrievals=0, step_gap_s=0.001, remote_agent="D",
    )


@pytest.mark.parametrize(
    "hbs, end, verdict, why",
    [
        ((1.0, 2.5), 6.5, PASS, "in bound"),  # deadline max(6, 6.5) = 6.5
        ((1.0, 2.5), 7.0, PASS, "in bound"),  # deadline + 0.5 tick
        ((1.0, 2.5), 7.01, FAIL, "after the bound"),
        ((1.0, 2.5), 6.2, FAIL, "premature"),  # before last heartbeat + E
        ((), 5.9, FAIL, "premature"),  # before grant + L
        ((), 6.0, PASS, "no heartbeat delivered"),
    ],
)
def test_one_lease_against_the_bound(hbs, end, verdict, why):
    row = check_lease_reclaim(lease(hbs=hbs, end=end), T6, tick_s=0.5)
    assert row.verdict == verdict
    assert why in row.reason
    assert row.bound_s == pytest.approx(max(6.0, (hbs[-1] if hbs else 0) + 4.0) + 0.5)
    assert row.measured_s == pytest.approx(end)


def test_released_and_aborted_leases():
    assert check_lease_reclaim(lease(outcome="released", end=2.0), T6, 0.5).verdict == UNKNOWN
    assert check_lease_reclaim(lease(outcome="aborted", end=2.0), T6, 0.5).verdict == FAIL


def test_lease_duration_mismatch_is_unknown():
    row = check_lease_reclaim(lease(L=30.0), T6, 0.5)
    assert row.verdict == UNKNOWN and "L=30.0" in row.reason


def test_aggregate_verdicts():
    ok = check_bounded_reclaim([lease("A"), lease("B", end=6.1)], ["A", "B"], T6, 0.5)
    assert ok.verdict == PASS and ok.details["min_margin_s"] == pytest.approx(0.0)  # A ends exactly on its bound
    missing = check_bounded_reclaim([lease("A")], ["A", "B"], T6, 0.5, waited_s=26)
    assert missing.verdict == FAIL and "still pinned" in missing.rows[1].reason
    partial = check_bounded_reclaim([lease("A")], ["A", "B"], T6, 0.5, partial=True)
    assert partial.verdict == PASS and partial.rows[1].verdict == UNKNOWN
    no_hb = check_bounded_reclaim([lease("A", hbs=(), end=6.0)], ["A"], T6, 0.5)
    assert no_hb.verdict == UNKNOWN and "did not exercise" in no_hb.summary
    all_released = check_bounded_reclaim([lease("A", outcome="released", end=1.0)], ["A"], T6, 0.5)
    assert all_released.verdict == UNKNOWN


def test_steady_state():
    served = {0: DecodeResult(200, 0.1, token_ids=[1]), 1: DecodeResult(200, 0.1, token_ids=[2])}
    released = [lease("A", outcome="released", end=9.0), lease("B", outcome="released", end=9.1)]
    ok = check_steady_state(released, ["A", "B"], served, T6)
    assert ok.verdict == PASS and ok.details["leases_outlived_L_on_heartbeats"]
    one_expired = check_steady_state([released[0], lease("B", end=6.0)], ["A", "B"], served, T6)
    assert one_expired.verdict == FAIL and one_expired.details["expiries"] == 1
    failed_decode = {0: served[0], 1: DecodeResult(500, 0.1, error="boom")}
    not_served = check_steady_state(released, ["A", "B"], failed_decode, T6)
    assert not_served.verdict == FAIL and "not served" in not_served.summary
    assert check_steady_state(released, ["A", "B"], failed_decode, T6, all_served=False).verdict == PASS


@pytest.mark.parametrize("b, premature, retry, why", [
    (lease("B", hbs=(1.0, 2.0), end=6.0), 0, True, "on time: P heard no heartbeat for 4.000 s (E = 4 s)"),
    (lease("B", hbs=(), end=6.2), 0, True, "on time: P heard no heartbeat in L = 6 s"),
    (lease("B", hbs=(1.0, 2.5), end=6.2), 1, False, "0.300 s before max(grant + L, last heartbeat + E) (premature reclaim)"),
    (lease("B", hbs=(), end=5.0), 1, False, "1.000 s before max(grant + L, last heartbeat + E) (premature reclaim)"),
])
def test_steady_state_expiries_are_told_premature_or_on_time(b, premature, retry, why):
    served = {0: DecodeResult(200, 0.1, token_ids=[1]), 1: DecodeResult(0, 3.0, error="ReadTimeout")}
    check = check_steady_state([lease("A", outcome="released", end=9.0), b], ["A", "B"], served, T6)
    assert check.verdict == FAIL and check.details["premature_expiries"] == premature
    assert why in check.rows[1].reason
    assert on_time_only(check) is retry  # only an on-time expiry (no fault, D not heard) is worth a second run
    allowed = check_steady_state([lease("A", outcome="released", end=9.0), b], ["A", "B"], served, T6,
                                 expiries_allowed=1, all_served=False)
    assert allowed.verdict == (FAIL if premature else PASS)  # an allowance never covers a premature expiry


def test_a_steady_state_that_failed_otherwise_is_not_run_again():
    served = {0: DecodeResult(200, 0.1, token_ids=[1]), 1: DecodeResult(200, 0.1, token_ids=[2])}
    released = [lease("A", outcome="released", end=9.0), lease("B", outcome="released", end=9.1)]
    assert not on_time_only(check_steady_state(released, ["A", "B"], served, T6))  # PASS
    assert not on_time_only(check_steady_state(released[:1], ["A", "B"], served, T6))  # no lease end seen for B
    aborted = check_steady_state([released[0], lease("B", outcome="aborted", end=3.0)], ["A", "B"], served, T6)
    assert aborted.verdict == FAIL and not on_time_only(aborted)
    unserved = check_steady_state(released, ["A", "B"], {0: served[0], 1: DecodeResult(500, 0.1, error="boom")}, T6)
    assert unserved.verdict == FAIL and not on_time_only(unserved)  # served nothing, no expiry: not the host
    # an on-time expiry of A beside an unanswered B whose lease was released: B's failure is not the host's
    mixed = check_steady_state([lease("A", end=6.0), released[1]], ["A", "B"],
                               {0: DecodeResult(0, 3.0, error="ReadTimeout"), 1: DecodeResult(500, 0.1, error="boom")}, T6)
    assert mixed.verdict == FAIL and not on_time_only(mixed)
    allowed = check_steady_state([lease("A", end=6.0), released[1]], ["A", "B"],
                                 {0: served[0], 1: DecodeResult(500, 0.1, error="boom")}, T6, expiries_allowed=1)
    assert allowed.verdict == FAIL and not on_time_only(allowed)


def test_reason_says_which_term_set_the_bound():
    assert "last heartbeat + E set it" in check_lease_reclaim(lease(hbs=(1.0, 2.5), end=6.5), T6, 0.5).reason
    assert "grant + L set it" in check_lease_reclaim(lease(hbs=(1.0,), end=6.0), T6, 0.5).reason


def test_fault_window_rules():
    fault = 100.0 + 4.5  # D killed 4.5 s after the grant
    inside = lease("A", hbs=(1.0, 2.0, 4.2), end=8.2)
    row = check_lease_reclaim(inside, T6, 0.5, fault_at_s=fault)
    assert row.verdict == PASS and row.fault_s == pytest.approx(4.5) and row.not_before_s == pytest.approx(8.2)
    ended_before = lease("B", hbs=(), end=1.0, outcome="expired")  # L=1-style expiry while D was alive
    assert check_lease_reclaim(ended_before, T6, 0.5, fault_at_s=fault).verdict in (UNKNOWN, FAIL)
    assert "before the fault" in check_lease_reclaim(lease("B", hbs=(), end=6.0), T6, 0.5, fault_at_s=106.5).reason
    still_beating = lease("C", hbs=(1.0, 4.0, 6.0), end=10.0)  # a heartbeat 1.5 s after the "kill"
    row = check_lease_reclaim(still_beating, T6, 0.5, fault_at_s=fault)
    assert row.verdict == UNKNOWN and "not silenced" in row.reason


def test_leases_that_ended_before_the_fault_never_make_a_pass():
    # the L=1 trap: every lease expired at grant + L while D was alive, then D was killed
    early = [lease(r, hbs=(), end=6.0) for r in "ABCD"]
    result = check_bounded_reclaim(early, list("ABCD"), T6, 0.5, fault_at_s=100.0 + 7.0)
    assert result.verdict == UNKNOWN
    # heartbeats that all arrive after the fault do not count as "exercised" either
    late_only = [lease("A", hbs=(4.0,), end=8.0)]
    assert check_bounded_reclaim(late_only, ["A"], T6, 0.5, fault_at_s=100.0 + 3.9).verdict == UNKNOWN


def test_log_evidence_stamp_latency_is_not_a_premature_reclaim():
    """Stock evidence stamps a heartbeat when the log line is written, after vLLM's clock read: a
    reap 4-10 ms before last-logged-heartbeat + E (measured under load) is within that uncertainty;
    50 ms beyond it is still a premature reclaim."""
    import dataclasses

    from leasekit.telemetry.vllm_log import LOG_STAMP_LATENCY_S

    logged = dataclasses.replace(lease(hbs=(1.0, 2.5), end=6.49), stamp_latency_s=LOG_STAMP_LATENCY_S)
    row = check_lease_reclaim(logged, T6, tick_s=0.5)
    assert row.verdict == PASS and "log-stamp uncertainty" in row.reason
    spans = lease(hbs=(1.0, 2.5), end=6.49)  # the same instants from spans: exact, so premature
    assert check_lease_reclaim(spans, T6, tick_s=0.5).verdict == FAIL
    way_early = dataclasses.replace(lease(hbs=(1.0, 2.5), end=6.5 - LOG_STAMP_LATENCY_S - 0.01),
                                    stamp_latency_s=LOG_STAMP_LATENCY_S)
    assert check_lease_reclaim(way_early, T6, tick_s=0.5).verdict == FAIL


def test_decode_conservation_fails_a_leak_and_cannot_judge_a_killed_or_unreadable_d():
    leak = check_decode_conservation(0.0125, waited_s=15.2)
    assert leak.verdict == FAIL and "1.25% used 15 s" in leak.summary and leak.name == "decode-conservation"
    assert check_decode_conservation(0.0, waited_s=0.1).verdict == PASS
    assert check_decode_conservation(None, waited_s=15).verdict == UNKNOWN
    killed = check_decode_conservation(0.5, waited_s=0, decode_killed=True)
    assert killed.verdict == UNKNOWN and "killed" in killed.summary


def test_all_served_names_what_was_not_answered():
    from leasekit.chaos.checks import check_all_served
    ok = check_all_served({0: DecodeResult(200, 0.1, token_ids=[1]), 1: DecodeResult(200, 0.1, token_ids=[2])}, [0, 1])
    assert ok.verdict == PASS and ok.summary == "2/2 served"
    bad = check_all_served({0: DecodeResult(500, 0.1, error="boom")}, [0, 1])
    assert bad.verdict == FAIL and bad.details["missing"] == [1] and "#0: HTTP 500 boom" in bad.summary
