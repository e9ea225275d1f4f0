"""Thin wrappers over grafana-foundation-sdk builders: every panel and query of the generated
dashboards goes through here, so each gets the ``${datasource}`` template data source, a
``refId`` and a Prometheus query of the right kind (range for graphs, instant for stats).

Grafana references: panel JSON model (grafana.com/docs/grafana/latest/dashboards/build-dashboards/
view-dashboard-json-model/), data source template variables (``${datasource}`` as the uid of a
``datasource``-type variable; no uid of one Grafana instance leaks into the file).
"""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dashboard_m

DATASOURCE_VARIABLE = "datasource"
DATASOURCE = dashboard_m.DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE_VARIABLE + "}")
"""Every panel, query, variable and annotation uses this: the ``$datasource`` variable."""

ALL = dashboard_m.VariableOption(selected=True, text=["All"], value=["$__all"])


@dataclass(frozen=True)
class Query:
    """One Prometheus query of a panel: ``expr`` (PromQL; may use Grafana variables) and the
    ``legend`` format (``{{label}}`` placeholders)."""

    expr: str
    legend: str


def _targets(queries: list[Query], *, instant: bool) -> list[prometheus_b.Dataquery]:
    if not queries:
        raise ValueError("a panel needs at least one query")
    targets = []
    for index, query in enumerate(queries):
        target = (prometheus_b.Dataquery().expr(query.expr).legend_format(query.legend)
                  .ref_id(chr(ord("A") + index)).datasource(DATASOURCE))
        targets.append(target.instant() if instant else target.range())
    return targets


def timeseries(title: str, description: str, queries: list[Query], unit: str, *,
               width: int = 8, height: int = 8, stacked: bool = False) -> timeseries_b.Panel:
    """A time-series panel of ``queries`` (range queries), ``unit`` a Grafana unit id
    (``s``, ``short``, ``ops``, ``percentunit``, ``Bps``), ``width`` in grid columns (of 24).

    Raises:
        ValueError: no queries.
    """
    panel = (timeseries_b.Panel().title(title).description(description).datasource(DATASOURCE)
             .targets(_targets(queries, instant=False)).unit(unit).span(width).height(height)
             .fill_opacity(10 if not stacked else 60).min(0)
             .legend(common_b.VizLegendOptions().show_legend(True)
                     .display_mode(common_m.LegendDisplayMode.TABLE)
                     .placement(common_m.LegendPlacement.BOTTOM).calcs(["lastNotNull", "max"]))
             .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                      .sort(common_m.SortOrder.DESCENDING)))
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    return panel


def stat(title: str, description: str, queries: list[Query], unit: str, *,
         width: int = 8, height: int = 8) -> stat_b.Panel:
    """A stat panel showing the last value of each series of ``queries`` (instant queries).

    Raises:
        ValueError: no queries.
    """
    return (stat_b.Panel().title(title).description(description).datasource(DATASOURCE)
            .targets(_targets(queries, instant=True)).unit(unit).span(width).height(height)
            .graph_mode(common_m.BigValueGraphMode.NONE).text_mode(common_m.BigValueTextMode.VALUE_AND_NAME)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def datasource_variable() -> dashboard_b.DatasourceVariable:
    """The ``datasource`` variable: any Prometheus data source of the Grafana instance."""
    return dashboard_b.DatasourceVariable(DATASOURCE_VARIABLE).label("Data source").type("prometheus")


def query_variable(name: str, label: str, query: str) -> dashboard_b.QueryVariable:
    """A multi-value variable with "All" (``.*``) filled from ``query`` (a ``label_values(...)``
    Grafana variable query), refreshed when the time range changes."""
    return (dashboard_b.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .multi(True).include_all(True).all_value(".*").current(ALL)
            .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_m.VariableSort.ALPHABETICAL_ASC))


def alerts_annotation(expr: str) -> dashboard_b.AnnotationQuery:
    """An annotation drawing ``expr`` (firing ``ALERTS`` series) on every graph."""
    return (dashboard_b.AnnotationQuery().name("LeaseKit alerts").datasource(DATASOURCE)
            .enable(True).icon_color("red").expr(expr))
