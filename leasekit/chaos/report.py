"""Reports: ``report.json`` (written atomically, also for interrupted runs) and terminal tables."""

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


def _verdict(verdict: str) -> str:
    return f"[{_STYLE.get(verdict, 'yellow')}]{verdict}[/]"


def make_console() -> Console:
    """A stdout console; wide enough for full request ids when not writing to a terminal."""
    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def reclaim_table(check: CheckResult, title: str) -> Table:
    """One row per lease, times in seconds after its grant: last heartbeat, fault, earliest allowed
    reclaim ("not before"), actual reclaim, bound, margin; then the verdict and why."""
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
            _fmt(row.fault_s), _fmt(row.not_before_s), _fmt(row.measured_s), _fmt(row.bound_s), _fmt(margin),
            _verdict(row.verdict), row.reason,
        )
    return table


def lease_table(check: CheckResult, title: str) -> Table:
    """One row per lease for checks without a bound: heartbeats, time (s after grant), outcome, why."""
    table = Table(title=title, title_justify="left")
    for column in ("request", "heartbeats", "t (s)", "outcome", "verdict", "why"):
        table.add_column(column, justify="right" if column in ("heartbeats", "t (s)") else "left")
    for row in check.rows:
        lease = row.lease
        table.add_row(row.request_id, "-" if lease is None else str(lease.heartbeat_count), _fmt(row.measured_s),
                      "-" if lease is None else lease.outcome, _verdict(row.verdict), row.reason)
    return table


def print_check(console: Console, check: CheckResult, prefix: str) -> None:
    """A check's verdict line, its per-lease table (if any) and its bound."""
    title = f"{prefix} {check.name}: {check.verdict} - {check.summary}"
    if check.rows and check.name == "bounded-reclaim":
        console.print(reclaim_table(check, title))
        d = check.details
        console.print(
            f"  bound: {d['bound']}; L={d['lease_duration_s']} s, H={d['heartbeat_interval_s']} s, E={d['extension_s']} s, "
            f"tick={d['tick_s']} s. Times are seconds after each lease's grant on P's clock; the fault instant is "
            "converted to that clock by the measured time-namespace offset (spans) or is the host wall clock (vLLM log)."
        )
    elif check.rows:
        console.print(lease_table(check, title))
    else:
        console.print(f"{_verdict(check.verdict)} {title}")


def print_results(report: dict, results: list, console: Console | None = None) -> None:
    """Every result's checks and effects, then the scenario x transfer mode x target matrix and the overall line."""
    console = console or make_console()
    for r in results:
        console.rule(f"{r.scenario} / {r.target} ({r.incident})")
        for effect in r.effects:
            mark = "[green]in effect[/]" if effect.took_effect else "[bold red]NOT in effect[/]"
            console.print(f"  fault {effect.fault}: {mark} - {effect.evidence}")
        if r.steady_state is not None:
            print_check(console, r.steady_state, f"{r.scenario} / {r.target}")
        for check in r.checks:
            print_check(console, check, f"{r.scenario} / {r.target}")
        if r.plot:
            console.print(f"  timeline: {r.plot}")
        expected = "" if r.as_expected else f" (expected {r.expected})"
        defect = f"\n  known defect: {r.known_defect}" if r.known_defect and r.verdict == FAIL else ""
        console.print(f"{r.scenario} / {r.target}: {_verdict(r.verdict)}{expected} - {r.summary}{defect}")
    targets = sorted({r.target for r in results}, key=lambda t: (t != "leasekit", t))
    if results:
        table = Table(title="conformance: verdict per scenario, transfer mode and target (expected in brackets when different)",
                      title_justify="left")
        table.add_column("scenario")
        table.add_column("mode")
        table.add_column("incident")
        for target in targets:
            table.add_column(target)
        for scenario, cells in report.get("matrix", {}).items():
            incident = next((r.incident for r in results if r.scenario == scenario), "")
            mode = next((r.mode for r in results if r.scenario == scenario), "pull")
            row = [scenario, mode, incident]
            for target in targets:
                cell = cells.get(target)
                if cell is None:
                    row.append("-")
                else:
                    text = _verdict(cell["verdict"])
                    row.append(text if cell["verdict"] == cell["expected"] else f"{text} [{cell['expected']}]")
            table.add_row(*row)
        console.print(table)
    console.print(f"overall: {_verdict(report.get('verdict', 'UNKNOWN'))} ({report.get('status')}) - report {report.get('report_path')}")
