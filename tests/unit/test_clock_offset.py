"""Clock-offset estimation and the turn-2 expiry check (vllm 0.32.0 base_worker.py, pull_worker.py)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease.clock import (
    KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S,
    ClockOffsetEstimator,
    local_to_remote,
    remote_to_local,
    turn2_read_expired,
    turn2_read_expired_strict,
)


def _round_trip(est, *, true_offset, t_send, to_remote, back):
    """One handshake: the peer reads its clock after ``to_remote`` seconds, the reply takes ``back``."""
    return est.add_sample(t_send, t_send + to_remote + true_offset, t_send + to_remote + back)


def test_empty_estimator():
    est = ClockOffsetEstimator()
    assert est.offset_s is None and est.rtt_s is None and est.error_bound_s is None and est.samples == 0


def test_symmetric_delays_give_the_exact_offset():
    est = ClockOffsetEstimator()
    assert _round_trip(est, true_offset=1000.0, t_send=10.0, to_remote=0.002, back=0.002)
    assert est.offset_s == pytest.approx(1000.0, abs=1e-9)
    assert est.rtt_s == pytest.approx(0.004)
    assert est.error_bound_s == pytest.approx(0.002)
    assert est.samples == 1


def test_matches_vllms_formula():
    start_time, remote_perf, recv_time = 5.0, 123.25, 5.5
    est = ClockOffsetEstimator()
    est.add_sample(start_time, remote_perf, recv_time)
    assert est.offset_s == remote_perf - (start_time + recv_time) / 2


@pytest.mark.parametrize("to_remote, back", [(0.0, 0.01), (0.01, 0.0), (0.009, 0.001), (0.3, 0.1)])
def test_asymmetric_delays_are_off_by_at_most_half_the_rtt(to_remote, back):
    est = ClockOffsetEstimator()
    _round_trip(est, true_offset=-50.0, t_send=2.0, to_remote=to_remote, back=back)
    error = abs(est.offset_s - (-50.0))
    assert error == pytest.approx(abs(to_remote - back) / 2)
    assert error <= est.error_bound_s + 1e-12


def test_lowest_rtt_wins_and_a_tie_keeps_the_first():
    est = ClockOffsetEstimator()
    assert est.add_sample(0.0, 100.0, 1.0)  # rtt 1.0, offset 99.5
    assert est.add_sample(10.0, 110.2, 10.2)  # rtt 0.2, offset 100.1
    assert not est.add_sample(20.0, 130.0, 20.5)  # worse
    assert not est.add_sample(30.0, 999.0, 30.2)  # tie: vLLM's `rtt < best_rtt` keeps the earlier one
    assert est.offset_s == pytest.approx(100.1) and est.rtt_s == pytest.approx(0.2)
    assert est.samples == 4


@given(
    st.lists(
        st.tuples(
            st.floats(0, 1e4, allow_nan=False),  # t_send
            st.floats(0, 10.0, allow_nan=False),  # one-way delay out
            st.floats(0, 10.0, allow_nan=False),  # one-way delay back
        ),
        min_size=1,
        max_size=12,
    ),
    st.floats(-1e6, 1e6, allow_nan=False),
    st.randoms(use_true_random=False),
)
def test_lowest_rtt_wins_regardless_of_order(trips, true_offset, rnd):
    samples = [(t, t + out + true_offset, t + out + back) for t, out, back in trips]
    shuffled = list(samples)
    rnd.shuffle(shuffled)
    est = ClockOffsetEstimator()
    for s in shuffled:
        est.add_sample(*s)
    best_rtt = min(r - s for s, _, r in samples)
    assert est.rtt_s == best_rtt
    winners = {rem - (s + r) / 2 for s, rem, r in samples if r - s == best_rtt}
    assert est.offset_s in winners  # equal-RTT samples may differ; the first of them in order wins
    assert abs(est.offset_s - true_offset) <= est.error_bound_s + 1e-6 * max(1.0, abs(true_offset))


@pytest.mark.parametrize(
    "args, name",
    [
        ((1.0, 0.0, 0.5), "t_recv_s"),
        ((math.nan, 0.0, 1.0), "t_send_s"),
        ((0.0, math.inf, 1.0), "remote_now_s"),
        ((0.0, 0.0, -math.inf), "t_recv_s"),
        ((0.0, True, 1.0), "remote_now_s"),
        ((0.0, "1", 1.0), "remote_now_s"),
    ],
)
def test_bad_samples_are_refused_and_change_nothing(args, name):
    est = ClockOffsetEstimator()
    est.add_sample(0.0, 7.0, 0.1)
    with pytest.raises(ValueError, match=name):
        est.add_sample(*args)
    assert est.samples == 1 and est.offset_s == pytest.approx(6.95)


def test_zero_rtt_is_allowed():
    est = ClockOffsetEstimator()
    est.add_sample(3.0, 8.0, 3.0)
    assert est.offset_s == 5.0 and est.error_bound_s == 0.0


def test_conversions_are_inverse():
    assert remote_to_local(1005.0, 1000.0) == 5.0
    assert local_to_remote(5.0, 1000.0) == 1005.0
    assert remote_to_local(local_to_remote(42.5, -3.25), -3.25) == 42.5
    with pytest.raises(ValueError, match="offset_s"):
        remote_to_local(1.0, math.nan)


def test_turn2_margin_edge_matches_vllms_ge():
    assert KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S == 5.0
    # D's deadline 1100 on D's clock, D = P + 1000 -> 100 on P's clock; expired from 95 on (>=).
    assert turn2_read_expired(95.0, 1100.0, 1000.0)  # exactly equal: expired
    assert not turn2_read_expired(94.999, 1100.0, 1000.0)
    assert turn2_read_expired(200.0, 1100.0, 1000.0)
    assert turn2_read_expired(100.0, 1100.0, 1000.0, margin_s=0.0)
    assert not turn2_read_expired(99.0, 1100.0, 1000.0, margin_s=0.0)


def test_turn2_same_as_vllm_expression():
    for now, deadline, offset in [(1.0, 2.0, 3.0), (1e5, 1e5 + 5.0, 0.0), (0.1, 0.3, -0.2)]:
        vllm = now + 5.0 >= deadline - offset
        assert turn2_read_expired(now, deadline, offset) is vllm


def test_strict_rule_subtracts_the_error_bound():
    # Not expired for vLLM at 94.5, but the offset may be 1 s off: the deadline may be 99 on P's clock.
    assert not turn2_read_expired(94.5, 1100.0, 1000.0)
    assert turn2_read_expired_strict(94.5, 1100.0, 1000.0, error_bound_s=1.0)
    assert turn2_read_expired_strict(94.0, 1100.0, 1000.0, error_bound_s=1.0)  # edge: equal is expired
    assert not turn2_read_expired_strict(93.9, 1100.0, 1000.0, error_bound_s=1.0)
    assert turn2_read_expired_strict(95.0, 1100.0, 1000.0, error_bound_s=0.0) == turn2_read_expired(95.0, 1100.0, 1000.0)


def test_strict_rule_with_an_estimator():
    est = ClockOffsetEstimator()
    est.add_sample(0.0, 1000.5, 1.0)  # rtt 1: offset 1000.0 +- 0.5
    assert turn2_read_expired_strict(94.6, 1100.0, est.offset_s, est.error_bound_s)
    assert not turn2_read_expired(94.6, 1100.0, est.offset_s)


@given(
    st.floats(-1e6, 1e6), st.floats(-1e6, 1e6), st.floats(-1e6, 1e6), st.floats(0, 100), st.floats(0, 100)
)
def test_strict_is_never_laxer(now, deadline, offset, bound, margin):
    if turn2_read_expired(now, deadline, offset, margin):
        assert turn2_read_expired_strict(now, deadline, offset, bound, margin)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: turn2_read_expired(math.nan, 1.0, 0.0), "now_local_s"),
        (lambda: turn2_read_expired(0.0, math.inf, 0.0), "remote_deadline_s"),
        (lambda: turn2_read_expired(0.0, 1.0, None), "offset_s"),
        (lambda: turn2_read_expired(0.0, 1.0, 0.0, margin_s=-1.0), "margin_s"),
        (lambda: turn2_read_expired_strict(0.0, 1.0, 0.0, -0.1), "error_bound_s"),
        (lambda: turn2_read_expired_strict(0.0, "x", 0.0, 0.1), "remote_deadline_s"),
    ],
)
def test_turn2_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()
