"""Scenario files: the catalog loads; bad input names the field and the allowed range."""

import re

import pytest

from leasekit.chaos.scenario import ScenarioError, find_scenario, list_scenarios, load_scenario

GOOD = """
name = "x"
description = "d"
incident = "K01"
[[faults]]
kind = "kill"
[expect]
checks = ["bounded_reclaim"]
"""

PARTITION = """
name = "x"
description = "d"
incident = "K11"
[launch]
network_namespace = true
[expect]
checks = ["liveness"]
[[faults]]
kind = "partition"
duration_s = "H"
"""


def write(tmp_path, text, name="x"):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_catalog_scenarios_all_load():
    catalog = list_scenarios()
    assert "kill-decode" in catalog
    for name in catalog:
        assert find_scenario(name).name == name


def test_kill_decode_defaults():
    s = find_scenario("kill-decode")
    t = s.lease.timing()
    assert (t.lease_duration_s, t.heartbeat_interval_s, t.extension_s) == (6, 1, 4)
    assert s.hold_decode_slot_s() == 9.0  # 1.5 * L
    assert s.fault_after_s(s.faults[0]) == 4.5  # kill: (L - E) + 2 * H + 0.5


@pytest.mark.parametrize(
    "extra, field, hint",
    [
        ("[lease]\nduration_s = -1", "lease.duration_s", "greater than 0"),
        ("[lease]\ntick_s = 100", "lease.tick_s", "less than or equal to 60"),
        ("[workload]\nrequests = 0", "workload.requests", "greater than or equal to 1"),
        ("[topology]\ntargets = ['mine']", "topology.targets.0", "'leasekit' or 'stock'"),
        ("[workload]\nkind = 'flood'", "workload.kind", "'queued', 'overload' or 'abort_storm'"),
        ("[[faults]]\nkind = 'stall'\nduration_s = 0", "faults.1.stall.duration_s", "allowed: 0 < value <= 600"),
        ("[lease]\nduraton_s = 6", "lease.duraton_s", "Extra inputs are not permitted"),
    ],
)
def test_bad_fields_are_named_with_the_allowed_range(tmp_path, extra, field, hint):
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, GOOD + extra))
    assert field in str(info.value) and hint in str(info.value)


def test_bad_incident_and_fault_kind(tmp_path):
    with pytest.raises(ScenarioError, match="incident"):
        load_scenario(write(tmp_path, GOOD.replace("K01", "K99")))
    with pytest.raises(ScenarioError, match="faults.0"):
        load_scenario(write(tmp_path, GOOD.replace('"kill"', '"flood"')))
    with pytest.raises(ScenarioError, match="expect.checks"):
        load_scenario(write(tmp_path, GOOD.replace('checks = ["bounded_reclaim"]', 'checks = ["vibes"]')))


def test_not_toml_and_missing(tmp_path):
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(write(tmp_path, "name = "))
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "nope.toml")


def test_unknown_name_lists_the_known_ones(tmp_path):
    write(tmp_path, GOOD)
    with pytest.raises(ScenarioError, match="known: x"):
        find_scenario("kill-everything", tmp_path)


def test_overrides_are_validated():
    s = find_scenario("kill-decode").with_overrides(lease_duration_s=12, targets=["stock"])
    assert s.lease.timing().extension_s == 8 and s.topology.targets == ["stock"]
    with pytest.raises(ScenarioError, match="lease.duration_s"):
        find_scenario("kill-decode").with_overrides(lease_duration_s=0)


@pytest.mark.parametrize("extra, field", [
    ("[lease]\nduration_s = true", "lease.duration_s"),
    ("[lease]\nduration_s = '6'", "lease.duration_s"),
    ("[workload]\nrequests = 4.0", "workload.requests"),
    ("[steady_state]\nall_served = 'yes'", "steady_state.all_served"),
])
def test_no_silent_type_coercion(tmp_path, extra, field):
    with pytest.raises(ScenarioError, match=field.replace(".", r"\.")):
        load_scenario(write(tmp_path, GOOD + extra))


def test_errors_give_both_ends_of_the_range(tmp_path):
    with pytest.raises(ScenarioError, match=r"allowed: 0 <= value <= 60"):
        load_scenario(write(tmp_path, GOOD + "[lease]\ntick_s = nan"))


def test_partition_needs_a_namespace_and_a_cold_pair_for_first_handshake(tmp_path):
    partition = GOOD.replace('kind = "kill"', 'kind = "partition"\nduration_s = 5\nfirst_handshake = true')
    with pytest.raises(ScenarioError, match="network_namespace"):
        load_scenario(write(tmp_path, partition))
    with pytest.raises(ScenarioError, match="warm_up = false"):
        load_scenario(write(tmp_path, partition + "[launch]\nnetwork_namespace = true\n"))
    ok = load_scenario(write(tmp_path, partition + "[launch]\nnetwork_namespace = true\nwarm_up = false\n"))
    assert ok.fault_after_s(ok.faults[0]) == 0.0


def test_every_catalog_scenario_names_its_checks_and_incident():
    for name in list_scenarios():
        s = find_scenario(name)
        assert s.expect.checks and s.incident.startswith("K")
        for target in s.topology.targets:
            if s.expect.verdict_for(target) == "FAIL":  # an expected FAIL must say which defect
                assert getattr(s.expect, f"known_defect_{target}"), (name, target)


@pytest.mark.parametrize("text, message", [
    (GOOD.replace('kind = "kill"', 'kind = "heartbeats"\ntarget = "prefill"') + "[topology]\ntargets = ['leasekit']\n",
     "faults.0.target: heartbeat faults live in D's send path"),
    (GOOD.replace('kind = "kill"', 'kind = "heartbeats"'), "set expect.stock = 'UNKNOWN'"),
    (GOOD.replace('kind = "kill"', 'kind = "kill"\ntarget = "prefill"\nrestart_after_s = 1'), "only a killed D is restarted"),
    (GOOD + "[workload]\nkind = 'overload'\nhold_decode_slot_s = 5\n", "an overload holds no slot for a time"),
    (GOOD + "[workload]\ncancel_after_s = 'H'\n", "cancel_after_s applies to kind = 'abort_storm' only"),
    (GOOD + "[workload]\nqueue_wait_s = '2L'\n", "queue_wait_s applies to kind = 'overload' only"),
    (PARTITION + "action = 'drop'\nloss_percent = 30\n", "loss_percent applies to action = 'loss' only"),
    (PARTITION + "action = 'loss'\nloss_percent = 0\n", "allowed: 1 <= loss_percent <= 100"),
    (GOOD + "[workload]\ncancel_queued_fraction = 0.6\nnever_decode_fraction = 0.6\n", "must be <= 1"),
    (GOOD.replace('checks = ["bounded_reclaim"]', 'checks = ["liveness", "liveness"]'), "each check once"),
    (GOOD.replace('checks = ["bounded_reclaim"]', 'checks = ["bounded_reclaim"]\nstock = "FAIL"'), "known_defect_stock"),
    (GOOD.replace('checks = ["bounded_reclaim"]', 'checks = ["bounded_reclaim"]\nstock = "FAIL"\nknown_defect_stock = "x"'),
     "failing_checks"),
])
def test_contradictions_are_refused(tmp_path, text, message):
    with pytest.raises(ScenarioError, match=re.escape(message)):
        load_scenario(write(tmp_path, text))


def test_name_must_match_the_file(tmp_path):
    with pytest.raises(ScenarioError, match="must match the file name 'y'"):
        load_scenario(write(tmp_path, GOOD, name="y"))


@pytest.mark.parametrize("kind", ["queued", "overload", "abort_storm"])
def test_every_workload_takes_any_slot_count(tmp_path, kind):
    s = load_scenario(write(tmp_path, GOOD + f"[topology]\ndecode_max_num_seqs = 256\n[workload]\nkind = '{kind}'\n"))
    assert s.topology.decode_max_num_seqs == 256 and s.workload.kind == kind
    with pytest.raises(ScenarioError, match=r"topology\.decode_max_num_seqs.*allowed: 1 <= value <= 256"):
        load_scenario(write(tmp_path, GOOD + "[topology]\ndecode_max_num_seqs = 257\n"))


WRITER_STALL = """
name = "x"
description = "d"
incident = "K09"
[topology]
transfer_mode = "push"
targets = ["leasekit"]
[workload]
hold_decode_slot_s = "2H + 1.5s"
[[faults]]
kind = "stall"
target = "prefill"
method = "push_writer"
duration_s = "E + 2s"
[expect]
checks = ["no_expiry"]
"""


def test_a_push_writer_stall_needs_p_push_mode_and_no_stock_expectation(tmp_path):
    ok = load_scenario(write(tmp_path, WRITER_STALL))
    assert ok.faults[0].duration_s == 6.0 and ok.fault_after_s(ok.faults[0]) == 2.5  # L = 6: E + 2 s; armed at 2H + 0.5 s
    with pytest.raises(ScenarioError, match="push_writer.*target = 'prefill'"):
        load_scenario(write(tmp_path, WRITER_STALL.replace('target = "prefill"', 'target = "decode"')))
    with pytest.raises(ScenarioError, match="transfer_mode = 'push'"):
        load_scenario(write(tmp_path, WRITER_STALL.replace('transfer_mode = "push"', 'transfer_mode = "pull"')))
    with pytest.raises(ScenarioError, match="cannot be injected into the stock connector"):
        load_scenario(write(tmp_path, WRITER_STALL.replace('targets = ["leasekit"]', 'targets = ["leasekit", "stock"]')))
    with pytest.raises(ScenarioError, match="hold_decode_slot_s set after"):  # else no WRITE comes while armed
        load_scenario(write(tmp_path, WRITER_STALL.replace('hold_decode_slot_s = "2H + 1.5s"', '')))
    with pytest.raises(ScenarioError, match="must be the scenario's only fault"):
        load_scenario(write(tmp_path, WRITER_STALL + '[[faults]]\nkind = "heartbeats"\ndrop_next = 1\n'))
    with pytest.raises(ScenarioError, match=r"hold_decode_slot_s: 1 s must be later than faults.0.after_s = 2.5 s"):
        load_scenario(write(tmp_path, WRITER_STALL.replace('hold_decode_slot_s = "2H + 1.5s"', 'hold_decode_slot_s = 1')))


def test_the_stock_target_of_a_push_writer_stall_is_unknown_with_the_reason():
    from leasekit.chaos.actions import not_injectable

    fault = find_scenario("stall-writer-push").faults[0]
    assert "push writer stall needs LeaseKit's connector on prefill" in not_injectable(
        fault, {"prefill": "stock", "decode": "stock"})
    assert not_injectable(fault, {"prefill": "leasekit", "decode": "leasekit"}) is None


def test_errors_name_the_field_suggest_the_spelling_and_list_the_fault_kinds(tmp_path):
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, GOOD + "[lease]\nduraton_s = 6\n"))
    assert "lease.duraton_s: Extra inputs are not permitted; fix: remove it or check the spelling (did you mean 'duration_s'?)" in str(info.value)
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, WRITER_STALL.replace('method = "push_writer"', 'method = "push_writer"\nmethd = 1')))
    assert "faults.0.stall.methd" in str(info.value) and "did you mean 'method'?" in str(info.value)
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, WRITER_STALL.replace('kind = "stall"\n', '')))
    assert "kill, stall, heartbeats, partition, none" in str(info.value)
    with pytest.raises(ScenarioError) as info:  # a cross-field rule that names its field is shown under it
        load_scenario(write(tmp_path, WRITER_STALL.replace('hold_decode_slot_s = "2H + 1.5s"', 'hold_decode_slot_s = 1')))
    assert "\n  workload.hold_decode_slot_s: 1 s must be later" in str(info.value) and "(top level)" not in str(info.value)
