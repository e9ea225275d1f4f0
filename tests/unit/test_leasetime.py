"""Lease-relative times and heartbeat counts: the grammar, its errors, and the catalog at any L."""

import pytest
from hypothesis import given, strategies as st

from leasekit.chaos.leasetime import COUNT_GRAMMAR, TIME_GRAMMAR, LeaseTimeError, parse_time, resolve_count
from leasekit.chaos.scenario import ScenarioError, find_scenario, list_scenarios, load_scenario
from leasekit.chaos.schema import HeartbeatFault, KillFault, PartitionFault, StallFault
from leasekit.lease.bounds import loss_budget, safe_stall_s
from leasekit.lease.config import LeaseTiming

T6, T30 = LeaseTiming.from_lease_duration(6), LeaseTiming.from_lease_duration(30)


@pytest.mark.parametrize("text, at6, at30", [
    ("E + 4s", 8, 24),
    ("L - E + 2H + 0.5s", 4.5, 20.5),
    ("1.5L", 9, 45),
    ("0.5H", 0.5, 2.5),
    ("2H", 2, 10),
    ("E+4H+5s", 13, 45),
    ("3L + 2s", 20, 92),
    ("  H  ", 1, 5),
    ("0.1s + 0.2s", 0.3, 0.3),
    ("L - E - H", 1, 5),
])
def test_expressions_resolve_at_both_lease_durations(text, at6, at30):
    expr = parse_time(text)
    assert expr.seconds(T6) == at6 and expr.seconds(T30) == at30


def test_a_float_lease_keeps_vllms_floor_division():
    timing = LeaseTiming.from_lease_duration(7.5)  # H = 7.5 // 6 = 1.0, E = 15 // 3 = 5.0
    assert parse_time("L + H + E").seconds(timing) == 13.5


@pytest.mark.parametrize("text, part", [
    ("", "a term is missing"),
    ("E +", "a term is missing"),
    ("E + + H", "a term is missing"),
    ("- E", "the first term takes no sign"),
    ("E + 4", "write 4s for 4 seconds"),
    ("2 E", "term '2 E'"),
    ("2e", "term '2e'"),
    ("E*2", "term 'E*2'"),
    ("(L - E)", "term '(L'"),
    ("1e3s", "term '1e3s'"),
    ("2EH", "term '2EH'"),
    ("Ls", "term 'Ls'"),
])
def test_bad_expressions_name_the_term_and_the_grammar(text, part):
    with pytest.raises(LeaseTimeError) as info:
        parse_time(text)
    assert part in str(info.value) and TIME_GRAMMAR in str(info.value) and repr(text) in str(info.value)


@st.composite
def expressions(draw):
    terms = draw(st.lists(st.tuples(st.sampled_from("+-"), st.integers(0, 400).map(lambda n: n / 4),
                                    st.sampled_from("LHEs")), min_size=1, max_size=5))
    text = " ".join(f"{'' if i == 0 else sign + ' '}{coef:g}{unit}" for i, (sign, coef, unit) in enumerate(terms))
    return text, terms


@given(expressions(), st.integers(1, 3600))
def test_any_written_expression_means_its_arithmetic(expr, lease):
    text, terms = expr
    timing = LeaseTiming.from_lease_duration(lease)
    unit = {"L": timing.lease_duration_s, "H": timing.heartbeat_interval_s, "E": timing.extension_s, "s": 1}
    want = sum((1 if i == 0 or sign == "+" else -1) * coef * unit[u] for i, (sign, coef, u) in enumerate(terms))
    assert parse_time(text).seconds(timing) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("text, lease, count", [
    ("budget", 6, 2), ("budget", 30, 2), ("budget", 10, 4), ("budget + 1", 6, 3), ("budget+1", 30, 3),
    ("budget - 1", 6, 1),
])
def test_budget_counts_follow_the_loss_budget(text, lease, count):
    assert resolve_count(text, LeaseTiming.from_lease_duration(lease)) == count


@pytest.mark.parametrize("text", ["budget+", "Budget", "2 + budget", "budget + 1.5", "budget * 2"])
def test_bad_counts_name_the_grammar(text):
    with pytest.raises(LeaseTimeError, match="not a heartbeat count") as info:
        resolve_count(text, T6)
    assert COUNT_GRAMMAR in str(info.value)


BASE = """
name = "x"
description = "d"
incident = "K01"
[topology]
targets = ["leasekit"]
[expect]
checks = ["bounded_reclaim"]
"""


def scenario(tmp_path, faults, extra=""):
    path = tmp_path / "x.toml"
    path.write_text(BASE + extra + faults)
    return load_scenario(path)


def test_fields_hold_seconds_and_remember_the_text(tmp_path):
    s = scenario(tmp_path, '[[faults]]\nkind = "stall"\nduration_s = "E + 4s"\nafter_s = 3\n'
                           '[[faults]]\nkind = "heartbeats"\ndrop_next = "budget + 1"\ndelay_next_s = "0.5H"\n',
                 '[workload]\nhold_decode_slot_s = "L + 2H"\n')
    assert (s.faults[0].duration_s, s.faults[0].after_s, s.faults[1].drop_next, s.faults[1].delay_next_s) == (8, 3, 3, 0.5)
    assert s.workload.hold_decode_slot_s == 8.0
    assert s.time_expressions == {"workload.hold_decode_slot_s": "L + 2H", "faults.0.duration_s": "E + 4s",
                                  "faults.1.drop_next": "budget + 1", "faults.1.delay_next_s": "0.5H"}
    t = s.with_overrides(lease_duration_s=30)
    assert (t.faults[0].duration_s, t.faults[0].after_s, t.faults[1].drop_next, t.faults[1].delay_next_s) == (24, 3, 3, 2.5)
    assert t.workload.hold_decode_slot_s == 40.0 and t.time_expressions == s.time_expressions
    assert t.with_overrides(lease_duration_s=6).faults[0].duration_s == 8  # back again: the text was kept


def test_an_expression_out_of_range_names_field_value_and_lease(tmp_path):
    with pytest.raises(ScenarioError) as info:
        scenario(tmp_path, '[[faults]]\nkind = "stall"\nduration_s = "E - 5s"\n')
    message = str(info.value)
    assert "faults.0.duration_s = 'E - 5s' is -1 s at L = 6 s (H = 1 s, E = 4 s)" in message
    assert "allowed: 0 < value <= 600" in message
    s = scenario(tmp_path, '[[faults]]\nkind = "stall"\nduration_s = "E + 4s"\n')
    with pytest.raises(ScenarioError, match=r"faults\.0\.duration_s = 'E \+ 4s' is 2404 s at L = 3600 s"):
        s.with_overrides(lease_duration_s=3600)


def test_a_budget_below_l6_is_refused_with_the_field(tmp_path):
    s = scenario(tmp_path, '[[faults]]\nkind = "heartbeats"\ndrop_next = "budget"\n')
    with pytest.raises(ScenarioError, match=r"faults\.0\.drop_next = 'budget' cannot be resolved at L = 5 s.*kv_lease_duration >= 6"):
        s.with_overrides(lease_duration_s=5)


@pytest.mark.parametrize("fault, field, hint", [
    ('kind = "stall"\nduration_s = "E + 4"', "faults.0.stall.duration_s", "write 4s for 4 seconds"),
    ('kind = "stall"\nduration_s = true', "faults.0.stall.duration_s", "not a time"),
    ('kind = "stall"\nduration_s = 0', "faults.0.stall.duration_s", "allowed: 0 < value <= 600"),
    ('kind = "kill"\nafter_s = "-E"', "faults.0.kill.after_s", "the first term takes no sign"),
    ('kind = "heartbeats"\ndrop_next = 2.0', "faults.0.heartbeats.drop_next", "not a heartbeat count"),
    ('kind = "heartbeats"\ndrop_next = "budget+"', "faults.0.heartbeats.drop_next", "not a heartbeat count"),
])
def test_field_errors_name_the_field(tmp_path, fault, field, hint):
    with pytest.raises(ScenarioError) as info:
        scenario(tmp_path, f"[[faults]]\n{fault}\n")
    assert field in str(info.value) and hint in str(info.value)


# -- the catalog ------------------------------------------------------------------------------

L6_SECONDS = {  # the catalog's resolved values at L = 6, unchanged from when they were written in seconds
    "abort-storm": {"workload.hold_decode_slot_s": 3.0, "workload.cancel_after_s": 3.0},
    "fp-stall-decode": {"workload.hold_decode_slot_s": 8.0, "faults.0.duration_s": 2.0},
    "handshake-partition": {"faults.0.duration_s": 20.0},
    "hb-loss-budget": {"workload.hold_decode_slot_s": 10.0, "faults.0.drop_next": 2},
    "hb-loss-over-budget": {"faults.0.drop_next": 3, "faults.0.delay_next_s": 0.5},
    "restart-decode": {"faults.0.restart_after_s": 1.0},
    "skew-monotonic": {"workload.hold_decode_slot_s": 9.0},
    "stall-decode-long": {"faults.0.duration_s": 8.0},
    "stall-decode-short": {"workload.hold_decode_slot_s": 8.0, "faults.0.duration_s": 2.0},
    "stall-prefill-long": {"workload.hold_decode_slot_s": 13.0, "faults.0.duration_s": 8.0},
    "wall-clock-jump": {"workload.hold_decode_slot_s": 9.0},
}


def value(s, path):
    section, *rest = path.split(".")
    node = getattr(s, section)
    for part in rest:
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


@pytest.mark.parametrize("name", sorted(L6_SECONDS))
def test_catalog_at_l6_keeps_its_seconds(name):
    s = find_scenario(name)
    assert s.lease.duration_s == 6
    assert {path: value(s, path) for path in L6_SECONDS[name]} == L6_SECONDS[name]


SCALED = sorted(L6_SECONDS) + ["kill-decode", "kill-decode-p-idle", "kill-decode-push", "overload-queue"]
"""The scenarios whose meaning at any L the rules below pin (files added later carry their own tests)."""


def catalog_at(lease, names=None):
    for name in names or list_scenarios():
        yield name, find_scenario(name).with_overrides(lease_duration_s=lease)


@pytest.mark.parametrize("lease", [6, 12, 30, 60])
def test_every_catalog_scenario_resolves_at_production_leases(lease):
    for name, s in catalog_at(lease):
        assert s.lease.timing().lease_duration_s == lease, name


def stalls(s, target):
    return [f for f in s.faults if isinstance(f, StallFault) and f.target == target]


@pytest.mark.parametrize("lease", [6, 12, 30, 60])
def test_the_catalog_means_the_same_at_any_l(lease):
    for name, s in catalog_at(lease, SCALED):
        t = s.lease.timing()
        L, H, E, tick = float(t.lease_duration_s), float(t.heartbeat_interval_s), float(t.extension_s), s.lease.tick_s
        hold = s.workload.hold_decode_slot_s
        for fault in stalls(s, "decode") + stalls(s, "prefill"):
            ends = s.fault_after_s(fault) + fault.duration_s
            if "no_expiry" in s.expect.checks and fault.target == "decode":  # a safe stall: shorter than E - H
                assert fault.duration_s < safe_stall_s(t), (name, lease)
            else:  # a long stall: past the extension (and P's step allowance)
                assert fault.duration_s > E + tick, (name, lease)
            if hold is not None:  # D's slots are released after the stall, with heartbeats in between
                assert hold >= ends + H, (name, lease)
        if hold is not None and "no_expiry" in s.expect.checks:
            assert hold > L, (name, lease)  # the queued leases outlive grant + L on heartbeats alone
        for fault in s.faults:
            if isinstance(fault, HeartbeatFault):
                budget = loss_budget(t)
                assert fault.drop_next == (budget if "no_expiry" in s.expect.checks else budget + 1), (name, lease)
                if fault.delay_next_s:
                    assert 0 < fault.delay_next_s < H, (name, lease)
            if isinstance(fault, KillFault):
                assert s.fault_after_s(fault) >= L - E + H, (name, lease)  # the last heartbeat sets the bound
                if fault.restart_after_s is not None:
                    assert fault.restart_after_s <= H, (name, lease)
            if isinstance(fault, PartitionFault) and fault.first_handshake:
                assert fault.duration_s > L + tick, (name, lease)  # outlives the leases D never reached
        if s.workload.kind == "abort_storm":
            assert s.workload.cancel_after_s <= hold, (name, lease)  # the cancels come while still queued


def test_stall_decode_long_outlasts_e_at_the_production_lease():
    s = find_scenario("stall-decode-long").with_overrides(lease_duration_s=30)
    assert s.faults[0].duration_s == 24.0 and s.lease.timing().extension_s == 20
