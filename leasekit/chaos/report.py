"""Reports: ``report.json`` (written atomically, also for interrupted runs) and a terminal table."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leasekit.chaos import FAIL, PASS
from leasekit.chaos.checks import CheckResult

_STYLE = {PASS: "green", FAIL: "bold red"}


def write_json(path: str | Path, report: dict) -> Path:
    """Write ``report`` as pretty JSON to ``path`` atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".report-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, sort_keys=False, default=str)
        handle.write("\n")
    os.replace(tmp, path)
    return path


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def reclaim_table(check: CheckResult, title: str) -> Table:
    """One row per lease, times in seconds after its grant: last heartbeat, fault, earliest allowed
    reclaim ("not before"), actual reclaim, bound, margin; then the verdict and its reason."""
    table = Table(title=title, title_justify="left")
    columns = ("request", "blocks", "heartbeats", "last HB", "fault", "not before", "reclaimed",
               "bound", "margin", "verdict", "why")
    for column in columns:
        table.add_column(column, justify="left" if column in ("request", "verdict", "why") else "right")
    for row in check.rows:
        lease = row.lease
        margin = None if row.bound_s is None or row.measured_s is None else row.bound_s - row.measured_s
        table.add_row(
            row.request_id,
            "-" if lease is None or lease.kv_blocks is None else str(lease.kv_blocks),
            "-" if lease is None else str(lease.heartbeat_count),
            "-" if lease is None else _fmt(lease.relative(lease.last_heartbeat_s)),
            _fmt(row.fault_s),
            _fmt(row.not_before_s),
            _fmt(row.measured_s),
            _fmt(row.bound_s),
            _fmt(margin),
            f"[{_STYLE.get(row.verdict, 'yellow')}]{row.verdict}[/]",
            row.reason,
        )
    return table


def steady_state_table(check: CheckResult, title: str) -> Table:
    """One row per lease of the fault-free run: heartbeats, lease life (s), outcome, verdict."""
    table = Table(title=title, title_justify="left")
    for column in ("request", "blocks", "heartbeats", "lease life (s)", "outcome", "verdict"):
        table.add_column(column, justify="right" if column in ("blocks", "heartbeats", "lease life (s)") else "left")
    for row in check.rows:
        lease = row.lease
        table.add_row(
            row.request_id,
            "-" if lease is None or lease.kv_blocks is None else str(lease.kv_blocks),
            "-" if lease is None else str(lease.heartbeat_count),
            _fmt(row.measured_s),
            "-" if lease is None else lease.outcome,
            f"[{_STYLE.get(row.verdict, 'yellow')}]{row.verdict}[/]",
        )
    return table


def make_console() -> Console:
    """A stdout console; wide enough for full request ids when not writing to a terminal."""
    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def print_report(report: dict, checks: list[CheckResult], console: Console | None = None) -> None:
    """Print the per-lease table of every check and the overall verdict line."""
    console = console or make_console()
    for check in checks:
        title = f"{report['scenario']} / {check.name}: {check.verdict} - {check.summary}"
        if check.name == "steady-state":
            console.print(steady_state_table(check, title))
            details = check.details
            console.print(
                f"  longest lease {_fmt(details.get('longest_lease_s'))} s vs L={details.get('lease_duration_s')} s: "
                + ("leases outlived L on heartbeats" if details.get("leases_outlived_L_on_heartbeats") else
                   "no lease outlived L (heartbeats not needed in this run)")
            )
            continue
        console.print(reclaim_table(check, title))
        bound = check.details.get("bound")
        if bound:
            console.print(
                f"  bound: {bound}; L={check.details['lease_duration_s']} s, "
                f"H={check.details['heartbeat_interval_s']} s, E={check.details['extension_s']} s, "
                f"tick={check.details['tick_s']} s. Times are seconds after each lease's grant on P's clock; "
                "the fault instant is converted to P's clock by the measured time-namespace offset."
            )
    for finding in report.get("lint") or []:
        console.print(f"[yellow]lint: {finding}[/]")
    verdict = report.get("verdict", "UNKNOWN")
    expected = "" if report.get("as_expected") or report.get("status") != "completed" else f", expected {report.get('expected_verdict')}"
    console.print(
        f"[{_STYLE.get(verdict, 'yellow')}]{report['scenario']}: {verdict}[/] ({report.get('status')}{expected}) "
        f"- report {report.get('report_path')}"
    )
