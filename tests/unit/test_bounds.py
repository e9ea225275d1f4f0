"""The lease timing derivation and the bound formulas (DESIGN.md "Bounds", CASES.md K01/K08)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease import LeaseConfigError, LeaseTiming, loss_budget, reclaim_bound, reclaim_deadline, safe_stall_s
from leasekit.lease.bounds import silence_may_expire


@pytest.mark.parametrize(
    "L, H, E",
    [(30, 5, 20), (6, 1, 4), (5, 0, 3), (1, 0, 0), (12, 2, 8), (480, 80, 320), (7.5, 1.0, 5.0), (31, 5, 20)],
)
def test_timing_is_derived_with_vllm_floor_division(L, H, E):
    t = LeaseTiming.from_lease_duration(L)
    assert (t.lease_duration_s, t.heartbeat_interval_s, t.extension_s) == (L, H, E)
    assert type(t.heartbeat_interval_s) is type(L)  # int stays int, float stays float (as vLLM keeps them)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "30", True, None])
def test_impossible_lease_duration_is_refused_with_the_field_named(bad):
    with pytest.raises(LeaseConfigError, match="kv_lease_duration"):
        LeaseTiming.from_lease_duration(bad)


def test_k01_reclaim_deadlines():
    t = LeaseTiming.from_lease_duration(30)
    assert reclaim_deadline(t, 0.0, 11.0) == 31.0  # heartbeats at 1, 6, 11; killed at 12
    assert reclaim_deadline(t, 0.0, 16.0) == 36.0  # variant: killed after the t=16 heartbeat
    assert reclaim_deadline(t, 0.0, None) == 30.0  # no heartbeat: the grant alone
    assert reclaim_deadline(t, 0.0, 2.0) == 30.0  # an early heartbeat never shortens the lease
    assert reclaim_bound(t, 0.0, 11.0, 0.1) == pytest.approx(31.1)


def test_bound_errors_name_the_bad_input():
    t = LeaseTiming.from_lease_duration(30)
    with pytest.raises(ValueError, match="precedes grant_s"):
        reclaim_deadline(t, 10.0, 9.0)
    with pytest.raises(ValueError, match="tick_s"):
        reclaim_bound(t, 0.0, None, -0.1)
    with pytest.raises(ValueError, match="grant_s"):
        reclaim_deadline(t, float("nan"), None)


def test_safe_stall_and_loss_budget_defaults():
    t30 = LeaseTiming.from_lease_duration(30)
    assert safe_stall_s(t30) == 15.0
    assert loss_budget(t30) == 2  # K08: 2 lost survive, the 3rd lands on the expiry instant
    assert safe_stall_s(LeaseTiming.from_lease_duration(1)) == 0.0


@pytest.mark.parametrize("L", [5, 1, 5.9])
def test_loss_budget_is_undefined_below_six_seconds(L):
    with pytest.raises(LeaseConfigError, match="kv_lease_duration"):
        loss_budget(LeaseTiming.from_lease_duration(L))


@given(st.integers(min_value=6, max_value=100_000))
def test_loss_budget_is_the_largest_k_below_the_ratio(L):
    t = LeaseTiming.from_lease_duration(L)
    k = loss_budget(t)
    H, E = t.heartbeat_interval_s, t.extension_s
    assert k * H < E - H  # k lost heartbeats are survived
    assert (k + 1) * H >= E - H  # one more is not guaranteed


@given(st.floats(min_value=6, max_value=1e5), st.floats(min_value=0, max_value=1e5), st.floats(min_value=0, max_value=1e5))
def test_deadline_is_never_before_grant_plus_L(L, grant, hb_offset):
    t = LeaseTiming.from_lease_duration(L)
    d = reclaim_deadline(t, grant, grant + hb_offset)
    assert d >= grant + L
    assert d >= grant + hb_offset + t.extension_s
    assert math.isfinite(d)


def test_loss_budget_of_an_overflowing_lease_is_an_error_not_a_crash():
    with pytest.raises(LeaseConfigError, match="not finite"):
        loss_budget(LeaseTiming.from_lease_duration(1e308))  # L * 2 overflows: E is nan


@given(st.integers(min_value=6, max_value=100_000))
def test_silence_may_expire_spares_the_loss_budget_and_flags_a_silence_near_e(lease_duration):
    t = LeaseTiming.from_lease_duration(lease_duration)
    H, E = t.heartbeat_interval_s, t.extension_s
    assert not silence_may_expire((loss_budget(t) + 1) * H, t)  # the budget's silence: P never expires it
    assert not silence_may_expire(H, t) and silence_may_expire(E, t)  # a silence of E may expire it at P
    between = ((loss_budget(t) + 1) * H + E) / 2
    assert silence_may_expire(max(E - H / 2, between), t) and not silence_may_expire(max(E - H / 2, between) - 1e-9, t)
    if (loss_budget(t) + 1) * H <= E - H:  # room for H/2 of delivery spread below E
        assert silence_may_expire(E - H / 2, t)


def test_silence_may_expire_refuses_a_negative_or_infinite_silence():
    t = LeaseTiming.from_lease_duration(6)
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="silence_s"):
            silence_may_expire(bad, t)
