"""The rule file and dashboard queries through Prometheus's own ``promtool`` (Debian package
``prometheus``): syntax, the alert unit tests in ``dashboards/tests/``, mutations those tests must
catch, and every dashboard query returning data on a synthetic scrape of every catalog metric.

Fails, never skips, without promtool: CI installs it (setup.sh)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from leasekit.dashboards import lease_health, rules
from leasekit.dashboards.checks import panel_queries
from leasekit.dashboards.promql import substitute_grafana_vars
from leasekit.telemetry import metrics as m

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
RULES_YML = DASHBOARDS / rules.FILE_NAME
TESTS = sorted((DASHBOARDS / "tests").glob("*.yml"))


@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: apt-get install prometheus (./setup.sh installs it)")
    return path


def run(promtool, *args, cwd=None):
    return subprocess.run([promtool, *args], check=False, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_rule_file_passes_promtool_check(promtool):
    doc = yaml.safe_load(RULES_YML.read_text())
    count = sum(len(g["rules"]) for g in doc["groups"])
    result = run(promtool, "check", "rules", str(RULES_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_alert_unit_tests_pass(promtool):
    assert len(TESTS) >= 7
    result = run(promtool, "test", "rules", *map(str, TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TESTS)


def test_every_alert_is_tested_firing_and_silent():
    firing, silent = set(), set()
    for path in TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            for case in group.get("alert_rule_test", []):
                (firing if case["exp_alerts"] else silent).add(case["alertname"])
    assert firing == silent == set(rules.ALERT_NAMES)


def _rule(doc, name):
    return next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == name or r.get("record") == name)


def _never(doc, name):
    _rule(doc, name)["expr"] = f"({_rule(doc, name)['expr']}) unless on () vector(1)"


def _replace(rule_name, old, new):
    def mutate(doc, _name):
        rule = _rule(doc, rule_name)
        if old == "for":
            rule["for"] = new
        else:
            assert old in rule["expr"], (rule_name, old)
            rule["expr"] = rule["expr"].replace(old, new)
    return mutate


MUTATIONS = {
    "LeaseExpiries": _replace(rules.EXPIRIES_BY_CAUSE, " unless leasekit_kv_lease_expiries_total offset 5m", ""),
    # each guard the alert has, removed: a silent case of its tests must then fail
    "LeaseExpiriesWhileDecodeHealthy": _replace("LeaseExpiriesWhileDecodeHealthy", '{peer_state="heartbeating"}', ""),
    "LeaseLateCompletions": _replace(
        rules.LATE_UNSAFE, ' unless leasekit_kv_lease_late_completions_total{fail_closed!="true"} offset 5m', ""),
    "LeaseReclaimLagOverBound": _replace("LeaseReclaimLagOverBound", f"clamp_min({rules.H_MAX}, 0.5)", rules.H_MAX),
    "LeasePinnedBlocksHigh": _replace(rules.PINNED, "max by (job, instance, engine)", "sum by (job, instance, engine)"),
    "LeaseHeartbeatGapNearExtension": _replace("LeaseHeartbeatGapNearExtension", "0.8 *", "0.2 *"),
    "LeaseHeartbeatSendFailures": _replace("LeaseHeartbeatSendFailures", "for", "0m"),
    "LeaseReadsDiscarded": _replace(rules.DISCARDED_BY_OUTCOME, 'outcome=~"reaped|timeout|ungated"', 'outcome=~".+"'),
}


def _run_mutated(promtool, tmp_path, mutate, name):
    doc = rules.rules_document(rules.RulesConfig())
    mutate(doc, name)
    (tmp_path / rules.FILE_NAME).write_text(rules.render_yaml(doc))
    shutil.copytree(DASHBOARDS / "tests", tmp_path / "tests")
    return run(promtool, "test", "rules", *(str(tmp_path / "tests" / p.name) for p in TESTS))


@pytest.mark.parametrize("name", rules.ALERT_NAMES)
def test_tests_catch_an_alert_that_never_fires(promtool, tmp_path, name):
    result = _run_mutated(promtool, tmp_path, _never, name)
    assert result.returncode != 0
    assert f"alertname: {name}" in result.stdout + result.stderr


@pytest.mark.parametrize("name", rules.ALERT_NAMES)
def test_tests_catch_an_alert_without_its_guard(promtool, tmp_path, name):
    """Removing the guard that keeps each alert silent (D alive, events in the window, the 0.5 s
    floor, max over ranks, the 0.8 * E margin, ``for``) makes a silent case of its tests fail."""
    result = _run_mutated(promtool, tmp_path, MUTATIONS[name], name)
    assert result.returncode != 0
    assert f"alertname: {name}" in result.stdout + result.stderr


def test_tests_catch_late_completions_paging_for_reads_a_fail_closed_d_discarded(promtool, tmp_path):
    """Without the ``fail_closed!="true"`` filter, LeaseLateCompletions would page for late reads a
    fail-closed D discarded; a silent case of its tests must then fail."""
    result = _run_mutated(promtool, tmp_path, _replace(rules.LATE_UNSAFE, '{fail_closed!="true"}', ""), "LeaseLateCompletions")
    assert result.returncode != 0
    assert "alertname: LeaseLateCompletions" in result.stdout + result.stderr


HEALTHY_D_GUARDS = {
    # the D was alive only if its agent still heartbeated: without the filter a dead D's silent expiries fire
    "peer_state": ('{peer_state="heartbeating"}', ""),
    # a stalled D that came back: without this operand the stall case stays silent
    "returns": (f"or\n{rules.PEER_RETURNS} > 0\n", ""),
    # TP skew: the expiring rank got no extension...
    "rank_without_extensions": (f"\n  and on (job, instance, engine, tp_rank) ({rules.EXTENSIONS_BY_RANK} == 0)", ""),
    # ...while another rank of its engine did
    "engine_with_extensions": (
        f"\n  and on (job, instance, engine) (sum by (job, instance, engine) ({rules.EXTENSIONS_BY_RANK}) > 0)", ""),
}


@pytest.mark.parametrize("guard", sorted(HEALTHY_D_GUARDS))
def test_tests_catch_each_way_expiries_while_decode_healthy_tells_a_live_d(promtool, tmp_path, guard):
    """LeaseExpiriesWhileDecodeHealthy joins on bounded labels only; each of its conditions (D state at
    the reap, returns of a silent D, the per-rank skew and its engine) is pinned by a case of its tests."""
    old, new = HEALTHY_D_GUARDS[guard]
    result = _run_mutated(promtool, tmp_path, _replace("LeaseExpiriesWhileDecodeHealthy", old, new),
                          "LeaseExpiriesWhileDecodeHealthy")
    assert result.returncode != 0
    assert "alertname: LeaseExpiriesWhileDecodeHealthy" in result.stdout + result.stderr


def test_no_rule_groups_or_joins_by_a_peer_name():
    """Rules aggregate and join only on bounded labels: no agent name (or request id) to group by exists."""
    text = RULES_YML.read_text()
    for label in ("remote_agent", "request_id", "req_id", "agent"):
        assert f"{label}," not in text and f"{label})" not in text and f"$labels.{label}" not in text, label


GRAFANA_VALUES = {"job": ".*", "instance": ".*", "__rate_interval": "1m", "__interval": "1m", "datasource": "x"}


def _dashboard_exprs():
    board = json.loads((DASHBOARDS / lease_health.FILE_NAME).read_text())
    return [(where, substitute_grafana_vars(expr, GRAFANA_VALUES)) for where, expr in panel_queries(board)]


def test_every_dashboard_query_parses(promtool, tmp_path):
    exprs = _dashboard_exprs()
    doc = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:query:{i}", "expr": expr} for i, (_, expr) in enumerate(exprs)]}]}
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(doc))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


LABEL_VALUES = {"tp_rank": "0", "remote_engine_id": "p-engine-0", "cause": "heartbeat_lapsed",
                "peer_state": "heartbeating", "outcome": "expired"}


def _synthetic_series():
    """One P server (p0) and one D server (d0) exporting every catalog metric on its side, all
    counters and histogram buckets growing by one per 15 s scrape."""
    series = []

    def add(name, labels, values):
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        series.append({"series": f"{name}{{{body}}}", "values": values})

    for instance, side, role in (("p0:8000", "P", "kv_producer"), ("d0:8000", "D", "kv_consumer")):
        base = {"job": "vllm", "instance": instance, "model_name": "m", "engine": "0"}
        for spec in m.LEASEKIT_METRICS:
            if spec.side not in (side, "both"):
                continue
            labels = {**base, "mode": "pull", **{k: LABEL_VALUES.get(k, role) for k in spec.labels}}
            if spec.kind == "histogram":
                for le in [*map(str, spec.buckets), "+Inf"]:
                    add(spec.name + "_bucket", {**labels, "le": le}, "0+1x60")
                add(spec.name + "_sum", labels, "0+1x60")
                add(spec.name + "_count", labels, "0+1x60")
            else:
                add(spec.sample_names[0], labels, "0+1x60" if spec.kind == "counter" else "5x60")
        for name, kind in m.VLLM_NIXL_METRICS.items():
            if kind == "histogram":
                for le in ("0.1", "1", "+Inf"):
                    add(name + "_bucket", {**base, "le": le}, "0+1x60")
                add(name + "_sum", base, "0+1x60")
                add(name + "_count", base, "0+1x60")
            else:
                add(name + "_total", base, "0+1x60")
    return series


def test_every_dashboard_query_returns_data_on_a_scrape_of_every_metric(promtool, tmp_path):
    """Each panel query, as an alert ``count(query) > 0``, must fire on the synthetic scrape: a
    query filtering on a label value no server exports, or joining mismatched labels, would not."""
    exprs = [(w, e) for w, e in _dashboard_exprs() if not w.startswith("annotation")]
    names = [f"PanelQuery{i}" for i in range(len(exprs))]
    rule_doc = {"groups": [{"name": "panels", "rules": [
        {"alert": n, "expr": f"count({e}) > 0"} for n, (_, e) in zip(names, exprs)]}]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rule_doc))
    test_doc = {"rule_files": ["panels.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "15s", "input_series": _synthetic_series(),
        "alert_rule_test": [{"eval_time": "10m", "alertname": n, "exp_alerts": [{"exp_labels": {}}]} for n in names],
    }]}
    (tmp_path / "panels_test.yml").write_text(yaml.safe_dump(test_doc))
    result = run(promtool, "test", "rules", "panels_test.yml", cwd=tmp_path)
    if result.returncode != 0:
        failing = [f"{where}: {expr}" for n, (where, expr) in zip(names, exprs) if f"alertname: {n}," in result.stdout]
        pytest.fail("queries returning no data:\n" + "\n".join(failing) + "\n" + result.stdout[-3000:])
