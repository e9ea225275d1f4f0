"""The PromQL tokenizer that finds the metric names dashboard and rule expressions read."""

import pytest

from leasekit.dashboards.promql import (
    PromQLError, metric_names, parse_names, substitute_grafana_vars, tokenize, unknown_functions,
    variable_query_metrics,
)


@pytest.mark.parametrize("expr, names", [
    ("up", {"up"}),
    ("vllm:nixl_xfer_time_seconds_count", {"vllm:nixl_xfer_time_seconds_count"}),
    # function names and range durations are not metrics
    ("rate(a_total[5m])", {"a_total"}),
    ("increase(a_total[1h30m])", {"a_total"}),
    # label names and values inside matchers are not metrics, even when they look like one
    ('a{job=~"b_total", instance="up", le="+Inf"}', {"a"}),
    # label lists after by / without / on / ignoring / group_left / group_right
    ("sum by (job, instance) (a)", {"a"}),
    ("sum without (tp_rank) (a)", {"a"}),
    ("sum(a) by (job)", {"a"}),
    ("a / on (job, instance) group_left (kv_role) b", {"a", "b"}),
    ("a + ignoring (cause) group_right b", {"a", "b"}),
    ("a > on () b", {"a", "b"}),
    # keywords are case-insensitive; set operators and bool are not metrics
    ("SUM BY (job) (a) AND b OR c UNLESS d", {"a", "b", "c", "d"}),
    ("a > bool 0.8", {"a"}),
    ("a atan2 b", {"a", "b"}),
    # numbers, Inf / NaN, hex, exponent; offsets (also negative); @ modifiers
    ("a * 0.8 + Inf - NaN + 0x1F + 1e-3", {"a"}),
    ("a offset 5m", {"a"}),
    ("a offset -1h", {"a"}),
    ("a @ start()", {"a"}),
    ("a @ 1609746000", {"a"}),
    # subqueries
    ("max_over_time(rate(a_total[1m])[10m:30s])", {"a_total"}),
    # strings are not metrics, whatever they contain
    ('label_replace(a, "dst", "$1", "src", "(b_total)")', {"a"}),
    ('count_values("le", a)', {"a"}),
    ("a # a comment naming b_total\n+ c", {"a", "c"}),
    # a metric named by __name__
    ('{__name__="a_total", job="x"}', {"a_total"}),
    # Grafana variables anywhere
    ('rate(a_total{job=~"$job"}[$__rate_interval]) offset $__interval', {"a_total"}),
    ('rate(a_total{instance=~"${instance:regex}"}[${__range}])', {"a_total"}),
    # histogram_quantile over a recorded series
    ("histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m]))) > 0.8 * on (job) level:e:max",
     {"x_bucket", "level:e:max"}),
    # aggregator name used as a metric name (legal PromQL when not followed by ( or by/without)
    ("count + 1", {"count"}),
])
def test_metric_names(expr, names):
    assert metric_names(expr) == frozenset(names)


def test_label_names_from_matchers_and_label_lists():
    parsed = parse_names('sum by (job, le) (rate(a_bucket{tp_rank!="1", cause=~"x|y"}[5m])) '
                         '/ on (job) group_left (kv_role) b{__name__="c"} + count_values("outcome", d)')
    assert parsed.labels == {"job", "le", "tp_rank", "cause", "kv_role"}  # __name__ names a metric
    assert parsed.metrics == {"a_bucket", "b", "c", "d"}


def test_functions_are_reported_separately_and_unknown_ones_flagged():
    parsed = parse_names("histogram_quantile(0.5, sum by (le) (rate(a_bucket[5m]))) + clamp_min(b, 1)")
    assert parsed.functions == {"histogram_quantile", "sum", "rate", "clamp_min"}
    assert unknown_functions("rat(a[5m]) + SUM(b)") == {"rat"}
    assert unknown_functions("sum by (job) (rate(a[5m]))") == frozenset()


@pytest.mark.parametrize("expr, fragment", [
    ("rate(a[5m]", "unclosed"),
    ("rate(a[5m]))", "unbalanced"),
    ("sum(a}", "unbalanced"),
    ('{__name__=~"a.*"}', "__name__"),
    ("a ; b", "unexpected character"),
])
def test_rejects_what_it_cannot_check(expr, fragment):
    with pytest.raises(PromQLError, match=fragment):
        parse_names(expr)


def test_tokenizer_keeps_positions_and_kinds():
    tokens = tokenize('rate(a{job="x"}[5m]) > 0.8')
    assert [(t.kind, t.text) for t in tokens] == [
        ("ident", "rate"), ("punct", "("), ("ident", "a"), ("punct", "{"), ("ident", "job"), ("op", "="),
        ("string", '"x"'), ("punct", "}"), ("punct", "["), ("duration", "5m"), ("punct", "]"), ("punct", ")"),
        ("op", ">"), ("number", "0.8"),
    ]
    assert tokens[2].pos == 5


def test_substitute_grafana_vars():
    expr = 'rate(a{job=~"$job", instance=~"${instance}"}[$__rate_interval])'
    out = substitute_grafana_vars(expr, {"job": ".*", "instance": ".*", "__rate_interval": "1m"})
    assert out == 'rate(a{job=~".*", instance=~".*"}[1m])'
    with pytest.raises(KeyError, match="instance"):
        substitute_grafana_vars(expr, {"job": ".*", "__rate_interval": "1m"})


def test_variable_queries():
    assert variable_query_metrics('label_values(a_seconds{job=~"$job"}, instance)') == {"a_seconds"}
    assert variable_query_metrics("label_values(job)") == frozenset()
    assert variable_query_metrics("query_result(sum by (job) (b_total))") == {"b_total"}
    with pytest.raises(PromQLError, match="unsupported"):
        variable_query_metrics("metrics(leasekit_.*)")
