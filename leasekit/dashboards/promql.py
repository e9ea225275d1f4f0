"""Which metric names and functions a PromQL expression references, from a real tokenizer.

The dashboard and rule checks must know every metric an expression reads, so a renamed or removed
metric fails the build instead of showing an empty panel in an incident. A regular expression over
the text cannot tell ``rate(x[5m])`` (function ``rate``, metric ``x``) from ``sum by (x) (y)``
(label ``x``), nor skip label values, durations and keywords, so this module tokenizes the
expression (Prometheus ``promql/parser/lex.go`` token classes) and walks it with a small context
stack. It does not build a syntax tree: syntax is the job of ``promtool check rules``, which the
tests run on every expression as well.

Grafana template syntax (``$job``, ``${datasource}``, ``$__rate_interval``) is accepted wherever
it can appear in a dashboard query and never counted as a metric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGGREGATORS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio",
})
"""PromQL aggregation operators (``promql/parser/lex.go``: ``key`` table, aggregators)."""

FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
    "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg",
    "delta", "deriv", "exp", "floor", "histogram_avg", "histogram_count", "histogram_fraction",
    "histogram_quantile", "histogram_stddev", "histogram_stdvar", "histogram_sum",
    "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad",
    "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label",
    "sort_by_label_desc", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time",
    "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year",
    # ``@ start()`` / ``@ end()`` modifiers
    "start", "end",
})
"""PromQL functions (``promql/parser/functions.go``, Prometheus 2.42 plus later additions)."""

KEYWORDS = frozenset({
    "and", "or", "unless", "atan2", "by", "without", "on", "ignoring", "group_left",
    "group_right", "bool", "offset", "inf", "nan",
})
"""Identifiers that are operators, modifiers or number literals, never metric names
(case-insensitive, as in ``lex.go``)."""

_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<duration>(?:[0-9]+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=])
  | (?P<punct>[(){}\[\],@])
""", re.VERBOSE)


class PromQLError(ValueError):
    """The expression cannot be tokenized, its brackets do not balance, or it names its metric in
    a way that cannot be checked (a ``__name__`` regex)."""


@dataclass(frozen=True)
class Token:
    """One lexical token: ``kind`` is a group name of the tokenizer (``ident``, ``string``,
    ``number``, ``duration``, ``var``, ``op``, ``punct``), ``text`` the source text, ``pos`` the
    character offset."""

    kind: str
    text: str
    pos: int


@dataclass(frozen=True)
class ExprNames:
    """What one expression references: ``metrics`` (series names, e.g. ``x_total``,
    ``x_bucket``), ``functions`` (function and aggregator names, as written) and ``labels``
    (label names in matchers and in ``by``/``without``/``on``/``ignoring``/``group_*`` lists)."""

    metrics: frozenset[str]
    functions: frozenset[str]
    labels: frozenset[str] = frozenset()


def tokenize(expr: str) -> list[Token]:
    """Split ``expr`` into tokens, dropping whitespace and ``#`` comments.

    Raises:
        PromQLError: a character no PromQL token starts with (the offset is in the message).
    """
    tokens: list[Token] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN_RE.match(expr, pos)
        if match is None:
            raise PromQLError(f"unexpected character {expr[pos]!r} at offset {pos} in {expr!r}")
        kind = match.lastgroup or ""
        if kind not in ("ws", "comment"):
            tokens.append(Token(kind, match.group(), pos))
        pos = match.end()
    return tokens


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    return bytes(text[1:-1], "utf-8").decode("unicode_escape")


def parse_names(expr: str) -> ExprNames:
    """The metric and function names ``expr`` references.

    An identifier is a metric name when it appears in expression context (not inside ``{...}``
    matchers, ``[...]`` ranges or the label list after ``by``/``without``/``on``/``ignoring``/
    ``group_left``/``group_right``), is not a keyword (:data:`KEYWORDS`), is not followed by
    ``(`` (a function call) and is not an aggregator followed by ``by``/``without``. A
    ``{__name__="x"}`` matcher names metric ``x``.

    Raises:
        PromQLError: untokenizable text, unbalanced brackets, or a ``__name__`` matcher other
            than ``=`` (the names it selects cannot be checked).
    """
    tokens = tokenize(expr)
    metrics: set[str] = set()
    functions: set[str] = set()
    labels: set[str] = set()
    stack: list[tuple[str, str]] = []  # (closing bracket, context: expr|labels|matchers|range)
    closers = {"(": ")", "{": "}", "[": "]"}
    for i, tok in enumerate(tokens):
        context = stack[-1][1] if stack else "expr"
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        prev = tokens[i - 1] if i > 0 else None
        if tok.kind == "punct" and tok.text in closers:
            if context != "expr":
                new = context  # nothing inside matchers, label lists or ranges names a metric
            elif tok.text == "(":
                label_list = prev is not None and prev.kind == "ident" and prev.text.lower() in _LABEL_LIST_KEYWORDS
                new = "labels" if label_list else "expr"
            else:
                new = "matchers" if tok.text == "{" else "range"
            stack.append((closers[tok.text], new))
            continue
        if tok.kind == "punct" and tok.text in ")}]":
            if not stack or stack[-1][0] != tok.text:
                raise PromQLError(f"unbalanced {tok.text!r} at offset {tok.pos} in {expr!r}")
            stack.pop()
            continue
        if context == "matchers" and tok.kind == "ident" and tok.text == "__name__":
            value = tokens[i + 2] if i + 2 < len(tokens) else None
            if nxt is None or nxt.text != "=" or value is None or value.kind != "string":
                raise PromQLError(f"__name__ matcher at offset {tok.pos} is not `__name__=\"...\"`; "
                                  f"its metric names cannot be checked: {expr!r}")
            metrics.add(_unquote(value.text))
            continue
        if tok.kind == "ident" and (context == "labels" or (context == "matchers" and nxt is not None
                                                              and nxt.kind == "op")):
            labels.add(tok.text)
            continue
        if context != "expr" or tok.kind != "ident":
            continue
        lowered = tok.text.lower()
        if lowered in KEYWORDS:
            continue
        if nxt is not None and nxt.text == "(":
            functions.add(tok.text)
        elif lowered in AGGREGATORS and nxt is not None and nxt.text.lower() in ("by", "without"):
            functions.add(tok.text)
        else:
            metrics.add(tok.text)
    if stack:
        raise PromQLError(f"unclosed {stack[-1][0]!r} missing at the end of {expr!r}")
    return ExprNames(frozenset(metrics), frozenset(functions), frozenset(labels))


def metric_names(expr: str) -> frozenset[str]:
    """The series names ``expr`` reads (see :func:`parse_names`; same errors)."""
    return parse_names(expr).metrics


def unknown_functions(expr: str) -> frozenset[str]:
    """Function names in ``expr`` that PromQL does not have (:data:`FUNCTIONS`,
    :data:`AGGREGATORS`; aggregators compared case-insensitively, as Prometheus does)."""
    return frozenset(
        f for f in parse_names(expr).functions
        if f not in FUNCTIONS and f.lower() not in AGGREGATORS
    )


_GRAFANA_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def substitute_grafana_vars(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana variables (``$name``, ``${name}``, ``${name:fmt}``) replaced by
    ``values[name]``, e.g. to hand a dashboard query to ``promtool``.

    Raises:
        KeyError: a variable with no value in ``values`` (its name is the key).
    """
    return _GRAFANA_VAR_RE.sub(lambda m: values[m.group(1) or m.group(2)], expr)


_LABEL_VALUES_RE = re.compile(r"^\s*label_values\((?:(?P<selector>.*),)?\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$",
                              re.DOTALL)
_QUERY_RESULT_RE = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.DOTALL)


def variable_query_metrics(query: str) -> frozenset[str]:
    """The metric names a Grafana Prometheus variable query reads: ``label_values(selector,
    label)``, ``label_values(label)`` (none) or ``query_result(expr)`` (Grafana's Prometheus
    data source "Query" variable syntax).

    Raises:
        PromQLError: another variable query form, or a selector :func:`parse_names` rejects.
    """
    match = _LABEL_VALUES_RE.match(query)
    if match:
        return metric_names(match.group("selector")) if match.group("selector") else frozenset()
    match = _QUERY_RESULT_RE.match(query)
    if match:
        return metric_names(match.group("expr"))
    raise PromQLError(f"unsupported Grafana variable query {query!r} (use label_values or query_result)")
