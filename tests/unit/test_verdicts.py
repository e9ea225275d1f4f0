"""Expected verdicts, the overall verdict and the JUnit outcome (pure logic, no pair)."""

import json

import pytest

from leasekit.chaos.checks import CheckResult
from leasekit.chaos.result import ScenarioResult
from leasekit.chaos.report import junit_verdict as _junit_verdict
from leasekit.chaos.suite import Suite


def result(verdict, expected, failed=(), passed=("bounded-reclaim",), expected_failing=(), summary="s"):
    checks = [CheckResult(n, "FAIL", "x") for n in failed] + [CheckResult(n, "PASS", "x") for n in passed]
    return ScenarioResult("sc", "stock", verdict, expected, summary, checks=checks, expected_failing=list(expected_failing))


def test_an_expected_fail_must_fail_exactly_the_named_checks():
    assert result("FAIL", "FAIL", failed=["fail-closed"], expected_failing=["fail_closed"]).as_expected
    regression = result("FAIL", "FAIL", failed=["fail-closed", "bounded-reclaim"], passed=(), expected_failing=["fail_closed"])
    assert not regression.as_expected  # bounded reclaim broke too: not the known defect alone
    assert not result("FAIL", "FAIL", failed=["bounded-reclaim"], expected_failing=["fail_closed"]).as_expected
    assert not result("PASS", "FAIL", expected_failing=["fail_closed"]).as_expected


@pytest.mark.parametrize("r, junit", [
    (result("PASS", "PASS"), "PASS"),
    (result("FAIL", "FAIL", failed=["fail-closed"], expected_failing=["fail_closed"]), "PASS"),
    (result("UNKNOWN", "UNKNOWN"), "UNKNOWN"),
    (result("FAIL", "PASS", failed=["bounded-reclaim"], passed=()), "FAIL"),
    (result("PASS", "FAIL", expected_failing=["fail_closed"]), "FAIL"),
    (result("UNKNOWN", "PASS"), "UNEXPECTED UNKNOWN"),
    (result("UNKNOWN", "PASS", summary="harness error: ServerStartError: x"), "HARNESS ERROR"),
])
def test_junit_colour_follows_the_expectation(r, junit):
    assert _junit_verdict(r) == junit


@pytest.mark.parametrize("results, status, overall", [
    ([result("PASS", "PASS")], "completed", "PASS"),
    ([result("PASS", "PASS"), result("PASS", "FAIL", expected_failing=["fail_closed"])], "completed", "FAIL"),
    ([result("PASS", "PASS"), result("UNKNOWN", "PASS")], "completed", "UNKNOWN"),
    ([result("PASS", "PASS")], "interrupted", "UNKNOWN"),
    ([], "completed", "UNKNOWN"),
])
def test_overall_verdict(tmp_path, results, status, overall):
    suite = Suite([], tmp_path)
    suite.results, suite.status = results, status
    assert suite.overall() == overall


def test_a_run_stopped_by_system_exit_reports_error_not_completed(tmp_path):
    """A closed stdout pipe makes rich raise SystemExit in the middle of a run: the report must not say completed."""
    from leasekit.chaos.scenario import find_scenario

    suite = Suite([(find_scenario("kill-decode"), "leasekit")], tmp_path)

    def stopped(scenario, target):
        raise SystemExit(1)

    suite.run_one = stopped
    with pytest.raises(SystemExit):
        suite.execute(show=False)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "error" and "SystemExit" in report["error"] and report["verdict"] != "PASS"
