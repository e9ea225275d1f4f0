"""JUnit XML report: parses back, with the counts and elements Jenkins and GitLab read."""

import math
import xml.etree.ElementTree as ET
from datetime import datetime, timezone

from leasekit.chaos.junit import MESSAGE_MAX_CHARS, JUnitCase, write_junit

CASES = [
    JUnitCase("kill-decode", "leasekit", "PASS", 42.5, 6.5, 6.102, "in bound; last heartbeat + E set it", "R1 expired at 6.102 s"),
    JUnitCase("kill-decode", "stock", "FAIL", 40.0, 6.5, 7.9, "reclaimed 1.400 s after the bound", "table\nrow"),
    JUnitCase("stall-decode", "stock", "UNKNOWN", 30.25, None, None, "no lease open at the fault"),
    JUnitCase("stall-prefill", "leasekit", "ERROR", float("nan"), "max(grant + L, hb + E) + tick", "n/a", "harness error"),
]


def load(path):
    root = ET.parse(path).getroot()  # raises if the XML is not well formed
    return root, root.find("testsuite")


def test_counts_elements_and_evidence(tmp_path):
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    summary = write_junit(tmp_path / "out" / "junit.xml", "leasekit-chaos", CASES, timestamp=when, hostname="ci-1")
    assert (summary.tests, summary.failures, summary.skipped, summary.errors, summary.malformed) == (4, 1, 1, 1, 0)
    root, suite = load(summary.path)
    assert root.tag == "testsuites" and suite.get("name") == "leasekit-chaos"
    for el in (root, suite):
        assert (el.get("tests"), el.get("failures"), el.get("skipped"), el.get("errors")) == ("4", "1", "1", "1")
        assert float(el.get("time")) == 42.5 + 40.0 + 30.25  # NaN duration counts as 0
    assert suite.get("timestamp") == "2026-01-02T03:04:05" and suite.get("hostname") == "ci-1"

    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [(c.target, c.name) for c in CASES]
    passed, failed, unknown, errored = cases
    assert [child.tag for child in passed] == ["system-out"]
    assert float(passed.get("time")) == 42.5
    failure = failed.find("failure")
    assert failure.get("type") == "FAIL"
    assert "reclaimed 1.400 s after the bound" in failure.get("message")
    assert "bound: 6.500 s" in failure.get("message") and "measured: 7.900 s" in failure.get("message")
    assert unknown.find("skipped").get("message").startswith("no lease open at the fault")
    assert errored.find("error") is not None and errored.get("time") == "0.000"
    assert "'ERROR' is not PASS/FAIL/UNKNOWN" in errored.find("error").get("message")
    out = failed.find("system-out").text
    assert "verdict: FAIL" in out and "bound: 6.500 s" in out and "table\nrow" in out
    assert "R1 expired at 6.102 s" in passed.find("system-out").text


def test_malformed_cases_are_counted_and_skipped(tmp_path):
    cases = [
        {"name": "kill-decode", "classname": "stock", "verdict": "PASS", "duration_s": 1},
        {"name": "", "verdict": "PASS"},
        {"verdict": "FAIL"},
        {"name": "x", "verdict": "FAIL", "duration_s": "soon"},
        42,
        None,
    ]
    summary = write_junit(tmp_path / "j.xml", "s", cases, hostname="h")
    assert (summary.tests, summary.malformed) == (1, 5)
    _, suite = load(summary.path)
    (case,) = suite.findall("testcase")
    assert case.get("classname") == "stock"


def test_illegal_xml_characters_and_long_messages(tmp_path):
    evidence = "\x1b[31mred\x1b[0m \x00 nul \ud800 surrogate ok"
    case = JUnitCase("k<&>\"", "t", "FAIL", 1.0, 1.0, 2.0, "x" * 5000, evidence)
    summary = write_junit(tmp_path / "j.xml", "suite & <co>", [case], hostname="h")
    root, suite = load(summary.path)
    tc = suite.find("testcase")
    assert tc.get("name") == "k<&>\""
    assert root.get("name") == "suite & <co>"
    assert len(tc.find("failure").get("message")) <= MESSAGE_MAX_CHARS
    assert "red" in tc.find("system-out").text and "\x1b" not in tc.find("system-out").text


def test_empty_suite(tmp_path):
    summary = write_junit(tmp_path / "j.xml", "empty", [], hostname="h")
    root, suite = load(summary.path)
    assert root.get("tests") == suite.get("tests") == "0"
    assert suite.findall("testcase") == [] and not math.isnan(float(suite.get("time")))


def test_transfer_mode_is_a_testcase_property_before_the_verdict(tmp_path):
    cases = [JUnitCase("kill-decode-push", "stock", "FAIL", 1.0, reason="r", properties={"transfer_mode": "push", "vllm_version": ""}),
             JUnitCase("kill-decode", "leasekit", "PASS", 1.0)]
    root, suite = load(write_junit(tmp_path / "j.xml", "s", cases).path)
    push, pull = suite.findall("testcase")
    assert [child.tag for child in push] == ["properties", "failure", "system-out"]
    assert [(p.get("name"), p.get("value")) for p in push.find("properties")] == [("transfer_mode", "push")]
    assert pull.find("properties") is None
    assert JUnitCase.from_mapping({"name": "n", "verdict": "PASS", "properties": {"transfer_mode": "pull"}}).properties == {
        "transfer_mode": "pull"}
