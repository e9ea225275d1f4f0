"""``leasekit dashboards build [--check]``: the generated Grafana dashboard and rule file, their
checks against the metric catalog, and the runbook the alerts link to."""

import argparse
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from leasekit.dashboards import build, checks, default_out_dir, lease_health, register, rules
from leasekit.dashboards.checks import (
    dashboard_problems, expression_modes, iter_panels, panel_queries, promtool_test_problems, rules_problems,
)
from leasekit.dashboards.panels import Query, timeseries
from leasekit.dashboards.promql import metric_names, tokenize
from leasekit.dashboards.queries import DASHBOARD_FILTER
from leasekit.telemetry import metrics as m

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
DASHBOARD_JSON = DASHBOARDS / lease_health.FILE_NAME
RULES_YML = DASHBOARDS / rules.FILE_NAME
RUNBOOK = REPO / "docs" / "runbook.md"
DS_REF = {"type": "prometheus", "uid": "${datasource}"}


def run_build(check, out_dir, config=None):
    out, err = io.StringIO(), io.StringIO()
    code = build(check, out_dir, config, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def board():
    return json.loads(DASHBOARD_JSON.read_text())


@pytest.fixture
def copy_dir(tmp_path):
    """A copy of the committed dashboards/ (generated files and promtool tests)."""
    target = tmp_path / "dashboards"
    shutil.copytree(DASHBOARDS, target)
    return target


def test_default_out_dir_is_the_repository_dashboards_dir():
    assert default_out_dir() == DASHBOARDS


def test_check_passes_on_committed_files():
    code, out, err = run_build(True, DASHBOARDS)
    assert (code, err) == (0, "")
    assert "up to date" in out


def test_build_is_deterministic_and_matches_committed_files(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert run_build(False, first)[0] == 0
    assert run_build(False, second)[0] == 0
    for name in (lease_health.FILE_NAME, rules.FILE_NAME):
        text = (first / name).read_bytes()
        assert text == (second / name).read_bytes() == (DASHBOARDS / name).read_bytes()
    text = (first / lease_health.FILE_NAME).read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


def test_stale_dashboard_fails_naming_file_and_difference(copy_dir):
    path = copy_dir / lease_health.FILE_NAME
    path.write_text(path.read_text().replace('"title": "Expiries by cause"', '"title": "Expiries (edited)"'))
    code, _, err = run_build(True, copy_dir)
    assert code == 1
    assert f"{path} is stale" in err
    assert '-      "title": "Expiries (edited)",' in err.splitlines()
    assert '+      "title": "Expiries by cause",' in err.splitlines()
    assert f"{copy_dir / rules.FILE_NAME} is" not in err  # the rule file is current
    assert path.read_text().count("Expiries (edited)") == 1  # --check writes nothing


def test_missing_or_changed_rule_file_fails(copy_dir):
    (copy_dir / rules.FILE_NAME).unlink()
    code, _, err = run_build(True, copy_dir)
    assert code == 1 and f"{copy_dir / rules.FILE_NAME} is missing" in err
    # the same committed file generated with another threshold is stale
    run_build(False, copy_dir)
    code, _, err = run_build(True, copy_dir, rules.RulesConfig(pinned_blocks_high=100))
    assert code == 1
    assert "> 100" in err and "> 4096" in err


def test_panel_with_unknown_metric_fails_and_writes_nothing(monkeypatch, tmp_path):
    original = lease_health._per_rank

    def with_bad_panel():
        return original() + [timeseries("Bogus", "reads a metric nobody exports",
                                        [Query(f"sum(rate(leasekit_kv_lease_bogus_total{{{DASHBOARD_FILTER}}}[5m]))",
                                               "x")], "ops")]

    monkeypatch.setattr(lease_health, "_per_rank", with_bad_panel)
    code, _, err = run_build(False, tmp_path)
    assert code == 1
    assert '"Bogus" target A: metric \'leasekit_kv_lease_bogus_total\' is not exported' in err
    assert "nothing written" in err and not list(tmp_path.iterdir())


def test_dashboard_problems_cover_targets_variables_and_functions(board):
    assert dashboard_problems(board, "d") == []
    panel = next(p for p in iter_panels(board) if p["type"] == "timeseries")
    panel["targets"].append({"refId": "Z", "expr": 'rate(vllm:nixl_nope_total[5m]) + rat(up[5m])'})
    board["templating"]["list"][1]["query"] = "label_values(leasekit_kv_lease_gone_seconds, job)"
    row_less = next(p for p in iter_panels(board) if p["type"] == "stat")
    row_less["targets"] = []
    problems = "\n".join(dashboard_problems(board, "d"))
    assert "metric 'vllm:nixl_nope_total' is not exported" in problems
    assert "unknown PromQL function rat()" in problems
    assert "variable job: metric 'leasekit_kv_lease_gone_seconds' is not exported" in problems
    assert f'"{row_less["title"]}" has no targets' in problems
    # the dashboard may not read recording rules: it must work without the rule file
    panel["targets"][-1]["expr"] = rules.PINNED
    assert any(rules.PINNED in p for p in dashboard_problems(board, "d"))


def test_rule_problems_allow_recorded_names_only_from_the_file():
    doc = rules.rules_document(rules.RulesConfig())
    assert rules_problems(doc, "r") == []
    doc["groups"][1]["rules"][0]["expr"] = "instance:not_recorded:rate5m > 0 and leasekit_kv_lease_grants"
    problems = rules_problems(doc, "r")
    assert len(problems) == 2
    assert "'instance:not_recorded:rate5m' is not exported" in problems[0]
    assert "'leasekit_kv_lease_grants' is not exported" in problems[1]  # counters need _total


def test_labels_must_be_carried_by_the_metrics_read():
    allowed = checks.allowed_names()
    # P-side lease counters name no D worker (bounded labels: cause, peer_state), D-side ones carry
    # remote_engine_id (the P engine)
    assert checks.expression_problems(
        "sum by (job, instance, peer_state, cause) (rate(leasekit_kv_lease_expiries_total[5m]))", "q", allowed) == []
    assert checks.expression_problems(
        "sum by (job, remote_agent) (rate(leasekit_kv_lease_extensions_total[5m]))", "q", allowed) == [
        "q: label 'remote_agent' is on none of leasekit_kv_lease_extensions_total"]
    assert checks.expression_problems(
        'sum by (remote_engine_id) (rate(leasekit_kv_lease_heartbeats_sent_total{tp_rank="0"}[5m]))', "q", allowed) == []
    problems = checks.expression_problems(
        'sum by (job, remote_engine_id) (rate(leasekit_kv_lease_expiries_total{kv_role="x"}[5m]))', "q", allowed)
    assert problems == ["q: label 'kv_role' is on none of leasekit_kv_lease_expiries_total",
                        "q: label 'remote_engine_id' is on none of leasekit_kv_lease_expiries_total"]
    # le only on buckets
    assert checks.expression_problems("sum by (le) (leasekit_kv_lease_hold_seconds_count)", "q", allowed) == [
        "q: label 'le' is on none of leasekit_kv_lease_hold_seconds_count"]
    assert checks.expression_problems("sum by (le) (leasekit_kv_lease_hold_seconds_bucket)", "q", allowed) == []


def test_promtool_test_files_must_feed_exported_series(tmp_path):
    doc = rules.rules_document(rules.RulesConfig())
    for test_file in sorted((DASHBOARDS / "tests").glob("*.yml")):
        assert promtool_test_problems(test_file, doc) == []
    bad = tmp_path / "bad.yml"
    good = 'job="j",instance="i",model_name="m",engine="0",mode="pull",tp_rank="0"'
    bad.write_text(yaml.safe_dump({"tests": [{
        "input_series": [
            {"series": f'leasekit_kv_lease_expiries{{{good},peer_state="silent",cause="no_heartbeat"}}', "values": "0"},
            {"series": f'leasekit_kv_lease_late_completions_total{{{good},remote_engine_id="e"}}', "values": "0"},
            {"series": f'leasekit_kv_lease_pinned_blocks{{{good}}}', "values": "0"},
        ],
        "promql_expr_test": [{"expr": "instance:leasekit_kv_lease_grants:rate5m + nope", "eval_time": "1m"}],
    }]}))
    problems = promtool_test_problems(bad, doc)
    assert len(problems) == 3
    assert "'leasekit_kv_lease_expiries' is not exported" in problems[0]  # counters are scraped as _total
    assert "labels ['engine', 'instance', 'job', 'mode', 'model_name', 'remote_engine_id', 'tp_rank'] differ from " \
           "the exported ['engine', 'fail_closed', 'instance', 'job', 'mode', 'model_name', 'tp_rank']" in problems[1]
    assert "'nope' is not exported" in problems[2]


def _walk(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield path + "/" + key, key, value
            yield from _walk(value, path + "/" + key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_datasource_is_a_template_variable_with_no_dangling_uid(board):
    datasources = [(p, v) for p, k, v in _walk(board) if k == "datasource"]
    assert len(datasources) > 60
    assert all(v == DS_REF for _, v in datasources), [p for p, v in datasources if v != DS_REF]
    uids = {v for _, k, v in _walk(board) if k == "uid"}
    assert uids == {"${datasource}", lease_health.UID}
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "current" not in variables["datasource"]  # no data source of one Grafana instance
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["datasource"] == DS_REF
    assert '$job' in variables["instance"]["query"]


def test_every_panel_has_targets_and_every_selector_filters_job_and_instance(board):
    panels = [p for p in iter_panels(board) if p["type"] != "row"]
    assert len(panels) >= 25
    for panel in panels:
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets) and all(t["refId"] for t in targets)
        for target in targets:
            expr = target["expr"]
            names = metric_names(expr)
            assert names, (panel["title"], expr)
            for tok in tokenize(expr):
                if tok.kind == "ident" and tok.text in names:
                    assert expr.startswith(f"{tok.text}{{{DASHBOARD_FILTER}", tok.pos), (panel["title"], expr)
            assert target["range"] is (panel["type"] == "timeseries")


def test_json_has_what_grafana_import_needs(board):
    assert board["title"] == "LeaseKit / KV lease health"
    assert re.fullmatch(r"[A-Za-z0-9_-]{8,40}", board["uid"])
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["time"] == {"from": "now-1h", "to": "now"}
    assert isinstance(board["templating"]["list"], list) and isinstance(board["annotations"]["list"], list)
    ids = [p["id"] for p in iter_panels(board)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    cells = set()
    for panel in board["panels"]:
        assert panel["type"] in {"row", "timeseries", "stat"}
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, f"panel {panel['id']} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            assert panel["collapsed"] is False and panel["panels"] == []  # expanded rows hold no panels


def test_rows_and_coverage_of_the_catalog(board):
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Leases now (P)", "Lease lifecycle (P)", "Heartbeats and bounds", "Remote peers",
                    "Per TP rank", "vLLM NIXL transfers (vllm:nixl_*)"]
    read = set().union(*(metric_names(t["expr"]) for p in iter_panels(board) for t in p.get("targets", [])))
    for spec in m.LEASEKIT_METRICS:
        assert read & set(spec.sample_names), f"no panel reads {spec.name}"
    unread_nixl = {n for n in m.VLLM_NIXL_METRICS if not any(s.startswith(n) for s in read)}
    assert unread_nixl == {"vllm:nixl_num_descriptors"}
    exprs = [t["expr"] for p in iter_panels(board) for t in p.get("targets", [])]
    assert not any("remote_agent" in e for e in exprs)  # P never names a D worker (bounded labels only)
    by_peer = {p["title"]: [t["expr"] for t in p["targets"]] for p in iter_panels(board)
               if "D state" in p["title"] or "by P engine" in p["title"]}
    assert len(by_peer) == 2
    for title, exprs in by_peer.items():  # P side by what P knew of the D at the reap, D side by P engine id
        if "(P)" in title:
            assert "peer_state" in exprs[0] and m.EXPIRED_PEER_RETURNS.sample_names[0] in exprs[1], title
        else:
            assert all("remote_engine_id" in e for e in exprs), title


def _slugs(markdown):
    """GitHub heading anchors of a markdown text."""
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE)}


def test_alerts_have_for_severity_annotations_and_runbook_anchors():
    doc = yaml.safe_load(RULES_YML.read_text())
    alerts = [r for g in doc["groups"] for r in g["rules"] if "alert" in r]
    assert tuple(a["alert"] for a in alerts) == rules.ALERT_NAMES
    anchors = _slugs(RUNBOOK.read_text())
    for alert in alerts:
        assert re.fullmatch(r"\d+m", alert["for"])
        assert alert["labels"]["severity"] in {"warning", "critical"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
        url = alert["annotations"]["runbook_url"]
        base, anchor = url.split("#")
        assert base == rules.DEFAULT_RUNBOOK_URL and base.endswith("docs/runbook.md")
        assert anchor in anchors, f"docs/runbook.md has no section for #{anchor}"


def test_runbook_url_and_threshold_are_configurable():
    config = rules.RulesConfig(runbook_url="https://wiki.example/lease-runbook", pinned_blocks_high=20000)
    doc = rules.rules_document(config)
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["LeaseLateCompletions"]["annotations"]["runbook_url"] == \
        "https://wiki.example/lease-runbook#leaselatecompletions"
    assert alerts["LeasePinnedBlocksHigh"]["expr"].endswith("> 20000")
    with pytest.raises(ValueError):
        rules.RulesConfig(pinned_blocks_high=0)
    with pytest.raises(ValueError):
        rules.RulesConfig(runbook_url="https://x/runbook.md#anchor")


def test_runbook_lists_every_metric_and_command():
    text = RUNBOOK.read_text()
    for spec in m.LEASEKIT_METRICS:
        assert f"`{spec.sample_names[0] if spec.kind == 'counter' else spec.name}`" in text, spec.name
    for name, kind in m.VLLM_NIXL_METRICS.items():
        assert f"`{name}_total`" in text if kind == "counter" else f"`{name}`" in text, name
    for command in ("leasekit status", "leasekit explain", "leasekit bounds", "leasekit lint", "leasekit chaos run"):
        assert command in text
    for name in re.findall(r"leasekit chaos run ([a-z0-9-]+)", text):
        assert (REPO / "chaos" / f"{name}.toml").is_file(), f"runbook names unknown scenario {name}"


def test_runbook_metric_table_matches_the_catalog():
    rows = {}
    for line in RUNBOOK.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `leasekit_") and len(cells) == 5:
            rows[cells[0].strip("`")] = cells
    assert len(rows) == len(m.LEASEKIT_METRICS)
    for spec in m.LEASEKIT_METRICS:
        name = spec.sample_names[0] if spec.kind == "counter" else spec.name
        _, kind, labels, side, _ = rows[name]
        assert kind == spec.kind and side == spec.side, name
        assert [label.strip("` ") for label in labels.split(",") if label.strip()] == list(spec.labels), name


def _parser():
    parser = argparse.ArgumentParser(prog="leasekit")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_register_adds_the_cli_subcommand(copy_dir, capsys):
    args = _parser().parse_args(["dashboards", "build", "--check", "--out", str(copy_dir)])
    assert args.func(args) == 0
    assert "up to date" in capsys.readouterr().out
    (copy_dir / rules.FILE_NAME).write_text("groups: []\n")
    assert args.func(args) == 1
    args = _parser().parse_args(["dashboards", "build", "--out", str(copy_dir), "--pinned-blocks-high", "123"])
    assert args.func(args) == 0
    assert "> 123" in (copy_dir / rules.FILE_NAME).read_text()
    for bad in (["--pinned-blocks-high", "0"], ["--runbook-url", "https://x/r.md#a"]):
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(["dashboards", "build", *bad])
        assert exc.value.code == 2


def test_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("")
    args = _parser().parse_args(["dashboards", "build", "--out", str(target)])
    assert args.func(args) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_expression_modes_name_the_modes_whose_servers_export_every_series_read():
    assert expression_modes('sum(rate(leasekit_kv_lease_grants_total[1m]))') == {"pull", "push"}
    assert expression_modes('sum(rate(leasekit_kv_lease_push_writes_total{outcome="done"}[1m]))') == {"push"}
    assert expression_modes('rate(leasekit_kv_lease_push_late_writes_total[1m]) + '
                            'rate(leasekit_kv_lease_grants_total[1m])') == {"push"}
    assert expression_modes("up") == {"pull", "push"}


def test_the_committed_dashboard_has_push_only_panels_and_no_pull_only_ones():
    """Push-only panels get data only from push pairs (checked on a real push pair); a pull pair checks the rest."""
    board = json.loads((DASHBOARDS / "lease-health.json").read_text())
    modes = [expression_modes(expr) for _, expr in panel_queries(board)]
    assert {"push"} in modes and {"pull"} not in modes and all(modes)
