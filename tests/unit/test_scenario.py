"""Scenario files: the catalog loads; bad input names the field and the allowed range."""

import pytest

from leasekit.chaos.scenario import ScenarioError, find_scenario, list_scenarios, load_scenario

GOOD = """
name = "x"
description = "d"
incident = "K01"
[[faults]]
kind = "kill"
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
    assert s.kill_after_s() == 4.5  # (L - E) + 2 * H + 0.5


@pytest.mark.parametrize(
    "extra, field, hint",
    [
        ("[lease]\nduration_s = -1", "lease.duration_s", "greater than 0"),
        ("[lease]\ntick_s = 100", "lease.tick_s", "less than or equal to 60"),
        ("[workload]\nrequests = 0", "workload.requests", "greater than or equal to 1"),
        ("[topology]\ndecode_connector = 'mine'", "topology.decode_connector", "'leasekit' or 'stock'"),
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
    with pytest.raises(ScenarioError, match="faults.0.kind"):
        load_scenario(write(tmp_path, GOOD.replace('"kill"', '"flood"')))


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
    s = find_scenario("kill-decode").with_overrides(lease_duration_s=12, decode_connector="stock")
    assert s.lease.timing().extension_s == 8 and s.topology.decode_connector == "stock"
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
