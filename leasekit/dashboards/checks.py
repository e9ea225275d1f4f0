"""Checks of generated dashboards, rule files and promtool tests against the metric catalog.

Following vLLM's ``tools/generate_grafana_dashboards.py --check``: every metric name an
expression reads must be one a LeaseKitConnector server exports
(:func:`leasekit.telemetry.metrics.exported_series_names`), or Prometheus's own ``up`` /
``ALERTS`` / ``ALERTS_FOR_STATE``, or (in rules and rule tests) a series a rule of the rule file
records. Names come from :mod:`leasekit.dashboards.promql`. Each check returns problems as
human-readable strings, empty when all is well.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from leasekit.dashboards.promql import PromQLError, parse_names, unknown_functions, variable_query_metrics
from leasekit.telemetry.metrics import (
    LEASEKIT_METRICS, MODE_LABEL, TRANSFER_MODES, VLLM_ENGINE_LABELS, VLLM_NIXL_METRICS, exported_series_names,
)

PROMETHEUS_SERIES = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE"})
"""Series Prometheus itself writes, allowed in any expression."""

TARGET_LABELS = ("job", "instance")
"""Labels Prometheus adds to every scraped series."""


def series_labels() -> dict[str, frozenset[str]]:
    """``{series name: label names it carries}`` for every exported series and ``up``: vLLM's
    engine labels, ``mode`` on LeaseKit's, the catalog's labels, :data:`TARGET_LABELS`, and ``le`` on ``*_bucket``."""
    base = frozenset(VLLM_ENGINE_LABELS + TARGET_LABELS)
    families = [(s.name, s.kind, frozenset(s.labels) | {MODE_LABEL}) for s in LEASEKIT_METRICS]
    families += [(name, kind, frozenset()) for name, kind in VLLM_NIXL_METRICS.items()]
    out = {"up": frozenset(TARGET_LABELS)}
    for name, kind, labels in families:
        if kind == "counter":
            out[name + "_total"] = base | labels
        elif kind == "histogram":
            out.update({name + "_sum": base | labels, name + "_count": base | labels,
                        name + "_bucket": base | labels | {"le"}})
        else:
            out[name] = base | labels
    return out


def allowed_names(recorded: frozenset[str] = frozenset()) -> frozenset[str]:
    """Series names an expression may read: the catalog's, :data:`PROMETHEUS_SERIES`, and
    ``recorded`` (names recorded by the rule file)."""
    return exported_series_names() | PROMETHEUS_SERIES | recorded


def expression_problems(expr: str, where: str, allowed: frozenset[str]) -> list[str]:
    """Problems of one PromQL expression found at ``where`` (e.g. ``panel 3 "Title" target A``):
    unparseable text, unknown functions, metric names not in ``allowed``, and, when it reads only
    scraped series (:func:`series_labels`), label names that none of them carries (a label the
    catalog renamed or dropped would otherwise aggregate silently into one empty-label series)."""
    try:
        parsed = parse_names(expr)
        bad_functions = unknown_functions(expr)
    except PromQLError as exc:
        return [f"{where}: {exc}"]
    problems = [f"{where}: unknown PromQL function {f}()" for f in sorted(bad_functions)]
    problems += [f"{where}: metric {n!r} is not exported (not in leasekit.telemetry.metrics)"
                 for n in sorted(parsed.metrics - allowed)]
    known = series_labels()
    if parsed.metrics and parsed.metrics <= known.keys():
        carried = frozenset().union(*(known[n] for n in parsed.metrics))
        problems += [f"{where}: label {label!r} is on none of {', '.join(sorted(parsed.metrics))}"
                     for label in sorted(parsed.labels - carried)]
    return problems


def expression_modes(expr: str) -> frozenset[str]:
    """The transfer modes (``pull``, ``push``) whose servers export every LeaseKit series ``expr`` reads
    (:attr:`leasekit.telemetry.metrics.MetricSpec.modes`): the modes in which a panel can show data. An
    expression reading no LeaseKit series gets every mode. Raises :class:`PromQLError` on unparseable text."""
    modes = set(TRANSFER_MODES)
    names = parse_names(expr).metrics
    for spec in LEASEKIT_METRICS:
        if names & set(spec.sample_names):
            modes &= set(spec.modes)
    return frozenset(modes)


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard JSON model, rows included, panels inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", []) or []


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, expr)`` of every Prometheus query of every non-row panel and annotation."""
    queries = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []) or []:
            where = f'panel {panel.get("id")} "{panel.get("title")}" target {target.get("refId")}'
            queries.append((where, target.get("expr", "")))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            queries.append((f'annotation "{annotation.get("name")}"', annotation["expr"]))
    return queries


def dashboard_problems(dashboard: dict[str, Any], name: str) -> list[str]:
    """Metric, function and structure problems of dashboard ``name``: every non-row panel has
    targets, every query and template-variable query reads only :func:`allowed_names` (no
    recording rules: the board must work without the rule file)."""
    allowed = allowed_names()
    problems = []
    for panel in iter_panels(dashboard):
        if panel.get("type") != "row" and not panel.get("targets"):
            problems.append(f'{name}: panel {panel.get("id")} "{panel.get("title")}" has no targets')
    for where, expr in panel_queries(dashboard):
        problems += expression_problems(expr, f"{name}: {where}", allowed)
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        where = f'{name}: variable {variable.get("name")}'
        try:
            unknown = variable_query_metrics(query) - allowed
        except PromQLError as exc:
            problems.append(f"{where}: {exc}")
            continue
        problems += [f"{where}: metric {n!r} is not exported" for n in sorted(unknown)]
    return problems


def recorded_names(rules: dict[str, Any]) -> frozenset[str]:
    """Series names the rule document records (``record:`` values)."""
    return frozenset(r["record"] for g in rules.get("groups", []) for r in g.get("rules", []) if "record" in r)


def rules_problems(rules: dict[str, Any], name: str) -> list[str]:
    """Metric and function problems of every ``expr`` of rule document ``name``."""
    allowed = allowed_names(recorded_names(rules))
    problems = []
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            label = rule.get("record") or rule.get("alert")
            problems += expression_problems(str(rule.get("expr", "")), f'{name}: rule {label}', allowed)
    return problems


def _series_name_labels(series: str) -> tuple[str, frozenset[str]]:
    """Metric name and label names of a promtool series description ``name{labels}``."""
    parsed = parse_names(series)
    if len(parsed.metrics) != 1:
        raise PromQLError(f"series {series!r} names {len(parsed.metrics)} metrics, expected 1")
    return next(iter(parsed.metrics)), parsed.labels


def promtool_test_problems(test_file: Path, rules: dict[str, Any]) -> list[str]:
    """Metric problems of a ``promtool test rules`` file: every ``input_series`` must be an
    exported series with exactly the labels a server gives it (tests must feed what servers
    really expose) and every ``promql_expr_test`` expression may read exported or recorded names."""
    try:
        doc = yaml.safe_load(test_file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"{test_file}: cannot read: {exc}"]
    labels_of, allowed = series_labels(), allowed_names(recorded_names(rules))
    problems = []
    for index, group in enumerate(doc.get("tests", []) or []):
        for series in group.get("input_series", []) or []:
            where = f"{test_file}: test {index} input series {series.get('series')!r}"
            try:
                name, labels = _series_name_labels(str(series.get("series", "")))
            except PromQLError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if name not in labels_of or name == "up":
                problems.append(f"{where}: metric {name!r} is not exported")
            elif labels != labels_of[name]:
                problems.append(f"{where}: labels {sorted(labels)} differ from the exported "
                                f"{sorted(labels_of[name])}")
        for expr_test in group.get("promql_expr_test", []) or []:
            problems += expression_problems(str(expr_test.get("expr", "")), f"{test_file}: test {index}", allowed)
    return problems
