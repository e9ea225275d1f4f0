"""``leasekit explain REQUEST_ID``: the lease timeline of one request, from the span files of a run.

Finds every ``kv_lease`` span naming the request (one per P TP rank), every ``kv_lease_late_read``
span and any other span naming it (e.g. D's heartbeat spans), and prints grant, extensions,
retrievals and the end with times after the grant (P's clock) and wall times, then the reclaim
bound check of each expired lease. A unique request id prefix is accepted.

Exit codes: 0 found; 1 nothing (or an ambiguous prefix) matches; 2 bad usage (e.g. the run dir
does not exist).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from leasekit.runbook.common import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    console,
    error,
    fmt_num,
    fmt_seconds,
    key_value_table,
    print_json,
    seconds_type,
)
from leasekit.runbook.spansearch import default_run_dir, match_request, search_spans, spans_for
from leasekit.runbook.timeline import explain_spans


def explain(request_id: str, run_dir: str, *, tick_s: float | None = None) -> tuple[int, dict[str, Any] | None, str]:
    """Explain ``request_id`` (or a unique prefix of it) from the spans under ``run_dir``.

    Args:
        request_id: the request id (``gen_ai.request.id``) or a prefix of it.
        run_dir: directory searched recursively for ``spans/`` directories.
        tick_s: P's step-period allowance in seconds for the bound; None uses each span's step gap.

    Returns:
        ``(exit_code, report, message)``: report (None unless found) is ``{"query", "request_id",
        "matched_by", "searched", "origin", "leases", "late_reads", "other_spans"}`` (see
        :func:`leasekit.runbook.timeline.explain_spans` and
        :meth:`leasekit.runbook.spansearch.SpanSearch.describe`); message says why nothing was found.
    """
    search = search_spans(run_dir)
    where = search.describe()
    searched = (f"searched {where['lease_spans']} lease span(s) ({where['spans']} spans, {where['files']} file(s)) "
                f"in {len(search.span_dirs)} span dir(s) under {run_dir}"
                + (": " + ", ".join(where["span_dirs"]) if search.span_dirs else "")
                + (f"; {where['bad_lines']} unreadable line(s) skipped (corrupt span files)" if where["bad_lines"] else ""))
    match = match_request(search.spans, request_id)
    if match.request_id is None:
        if match.candidates:
            shown = ", ".join(match.candidates[:10]) + (", ..." if len(match.candidates) > 10 else "")
            return EXIT_FAIL, None, (f"request id prefix {request_id!r} matches {len(match.candidates)} requests "
                                     f"({shown}); give more of it; {searched}")
        return EXIT_FAIL, None, f"no span names request id {request_id!r} (exact or prefix); {searched}"
    report = {"query": request_id, "request_id": match.request_id, "matched_by": match.matched_by,
              "searched": where, **explain_spans(spans_for(search.spans, match.request_id), tick_s)}
    return EXIT_OK, report, ""


def _who(view: dict[str, Any]) -> str:
    return (f"{view['span']} engine={view['engine_id']} tp_rank={view['tp_rank']} kv_role={view['kv_role']} "
            f"pid={view['pid']}")


def _details(attributes: dict[str, Any]) -> str:
    return ", ".join(f"{k.removeprefix('leasekit.')}={fmt_num(v)}" for k, v in attributes.items())


def _render_lease(out, view: dict[str, Any]) -> None:
    rows = [
        ("source", view["source"]), ("remote peer (ref)", view["remote_agent"] or "-"),
        ("KV blocks", view["kv_blocks"]),
        ("L / E", f"{fmt_num(view['lease_duration_s'])} s / {fmt_num(view['extension_s'])} s"),
        ("outcome", view["outcome"] or "open (no end recorded)"),
        ("grant (wall)", view["grant_wall"] or "-"), ("end (wall)", view["end_wall"] or "-"),
        ("initial deadline", fmt_seconds(view["initial_deadline_s"], signed=True)),
        ("last extend", fmt_seconds(view["last_extend_s"], signed=True)),
        ("final deadline", fmt_seconds(view["deadline_s"], signed=True)),
        ("end", fmt_seconds(view["end_s"], signed=True)),
        ("extend_count / events kept", (f"{fmt_num(view['extend_count'])} / {view['extend_events_kept']} "
                                        f"(dropped {fmt_num(view['extend_events_dropped'])})")),
        ("retrievals", view["retrievals"]), ("reclaim lag", fmt_seconds(view["reclaim_lag_s"])),
        ("step gap", fmt_seconds(view["step_gap_s"])),
    ]
    if view.get("expiry_peer_state"):
        rows.append(("D at expiry", view["expiry_peer_state"]))
    if view["abort_reason"]:
        rows.append(("abort reason", view["abort_reason"]))
    out.print(key_value_table(_who(view) + "  (times after the grant, P's clock)", rows))
    table = Table(title_justify="left")
    for column in ("t after grant", "wall time", "event", "deadline remaining", "details"):
        table.add_column(column)
    for ev in view["events"]:
        table.add_row(fmt_seconds(ev["t_after_grant_s"], signed=True), ev["wall_time"] or "-", escape(ev["event"]),
                      fmt_seconds(ev["deadline_remaining_s"]), escape(_details(ev["attributes"])))
    out.print(table)
    b = view["bound"]
    out.print(f"bound check: {b['verdict']}: {escape(b['detail'])}")
    if b["bound_s"] is not None:
        out.print(f"  reclaim deadline {fmt_seconds(b['reclaim_deadline_s'], signed=True)}, bound (+tick) "
                  f"{fmt_seconds(b['bound_s'], signed=True)}, actual end {fmt_seconds(b['actual_end_s'], signed=True)}")
    if b["recorded_deadline_s"] is not None and b["reclaim_deadline_s"] is not None \
            and abs(b["recorded_deadline_s"] - b["reclaim_deadline_s"]) > 1e-3:
        out.print(f"  note: P recorded deadline {fmt_seconds(b['recorded_deadline_s'], signed=True)}, the formula "
                  f"gives {fmt_seconds(b['reclaim_deadline_s'], signed=True)}")


def render_table(report: dict[str, Any]) -> None:
    """Print an :func:`explain` report: a header, each lease (summary, events, bound), late reads,
    then other spans with wall-clock times after the origin."""
    out = console()
    s = report["searched"]
    how = "" if report["matched_by"] == "exact" else f" (matched prefix {report['query']!r})"
    out.print(f"request {escape(report['request_id'])}{escape(how)}: {len(report['leases'])} lease span(s), "
              f"{len(report['late_reads'])} late read(s), {len(report['other_spans'])} other span(s); "
              f"searched {s['lease_spans']} lease spans in {len(s['span_dirs'])} span dir(s) under "
              f"{escape(s['run_dir'])}; origin: {report['origin']['what']} at {report['origin']['wall_time']}")
    for view in report["leases"]:
        _render_lease(out, view)
    for view in report["late_reads"]:
        out.print(f"LATE READ {escape(_who(view))}: at {fmt_seconds(view['t_after_grant_s'], signed=True)} after the "
                  f"grant ({view['wall_time']}), {fmt_seconds(view['late_by_s'])} after the lease ended "
                  f"{view['ended_outcome']} at {fmt_seconds(view['end_after_grant_s'], signed=True)}; remote peer "
                  f"{escape(str(view['remote_agent']))}: the read may have used freed KV blocks")
    for view in report["other_spans"]:
        out.print(f"{escape(_who(view))}: {fmt_seconds(view['start_after_origin_wall_s'], signed=True)} .. "
                  f"{fmt_seconds(view['end_after_origin_wall_s'], signed=True)} after the origin (wall clock, "
                  f"{view['start_wall']} .. {view['end_wall']}); {escape(_details(view['attributes']))}")
        for ev in view["events"]:
            own = "" if ev["t_own_clock_s"] is None else f" (own clock {fmt_seconds(ev['t_own_clock_s'], signed=True)})"
            out.print(f"  {fmt_seconds(ev['t_after_origin_wall_s'], signed=True)}{own}  {ev['wall_time']}  "
                      f"{escape(ev['event'])}  {escape(_details(ev['attributes']))}")


def _cmd_explain(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or str(default_run_dir())
    if not Path(run_dir).is_dir():
        error(f"run dir {run_dir} is not a directory; pass --run-dir or set LEASEKIT_RUN_DIR")
        return EXIT_USAGE
    code, report, message = explain(args.request_id, run_dir, tick_s=args.tick)
    if report is not None and report["searched"].get("bad_lines"):
        error(f"warning: {report['searched']['bad_lines']} unreadable span line(s) skipped under {run_dir} "
              "(corrupt span files): the timeline may miss spans")
    if report is None:
        error(message)
        return code
    if args.output == "json":
        print_json(report)
    else:
        render_table(report)
    return code


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``explain`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns its parser.

    The parser's ``func`` default is the handler: ``args.func(args)`` returns the exit code.
    """
    p = subparsers.add_parser("explain", help="the lease timeline of one request from a run's span files",
                              description=(
                                  "The lease timeline of one request from the span files of a run: every kv_lease "
                                  "span (one per P TP rank), late reads and other spans naming it, with the reclaim "
                                  "bound check. Exit codes: 0 found; 1 not found or an ambiguous prefix; 2 bad usage."))
    p.add_argument("request_id", metavar="REQUEST_ID", help="gen_ai.request.id, or a unique prefix of it")
    p.add_argument("--run-dir",
                   help="searched recursively for spans/ dirs (default $LEASEKIT_RUN_DIR, else ./leasekit-run)")
    p.add_argument("--tick", type=seconds_type(0, 60, low_inclusive=True), default=None,
                   help="P's step period allowance for the bound, 0-60 s (default: the step gap each span recorded)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=_cmd_explain)
    return p
