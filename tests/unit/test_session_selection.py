"""The session's own selection rules (tests/conftest.py): which stock catalog cases the tests run,
and the shared pair's users kept together."""

from types import SimpleNamespace

from leasekit.chaos.scenario import find_scenario, list_scenarios
from tests.conftest import STOCK_BASELINE, _shared_pair_users_together, _stock_case_kept


def test_stock_cases_kept_are_the_expected_fails_unknowns_and_the_baseline():
    kept = {name for name in list_scenarios() if _stock_case_kept(find_scenario(name))}
    for name in list_scenarios():
        scenario = find_scenario(name)
        if scenario.expect.verdict_for("stock") == "FAIL":
            assert name in kept, f"{name}: every known stock defect stays in the tests"
    assert set(STOCK_BASELINE) <= kept
    passing = {n for n in list_scenarios() if find_scenario(n).expect.verdict_for("stock") == "PASS"}
    assert kept & passing == set(STOCK_BASELINE), "a stock PASS outside the baseline runs only in the main job"
    assert {"partition-long", "stall-decode-long", "stall-decode-push"} <= kept


def _item(name, *fixtures):
    return SimpleNamespace(name=name, fixturenames=fixtures)


def test_shared_pair_users_move_next_to_the_first_one_and_nothing_else_moves():
    items = [_item("a"), _item("h1", "shared_pair"), _item("h2", "shared_pair"), _item("i1", "tmp_path"),
             _item("i2"), _item("o1", "shared_pair", "tmp_path"), _item("z")]
    _shared_pair_users_together(items)
    assert [i.name for i in items] == ["a", "h1", "h2", "o1", "i1", "i2", "z"]
    none = [_item("a"), _item("b")]
    _shared_pair_users_together(none)
    assert [i.name for i in none] == ["a", "b"]
