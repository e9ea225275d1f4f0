"""Reports: ``report.json`` (written atomically, also for interrupted runs), terminal tables, the
conformance matrix's rows (scenario x transfer mode x vLLM release x target, per pair file) and the JUnit
test cases of a run's results."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.checks import CheckResult
from leasekit.chaos.junit import JUnitCase

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


def print_results(report: dict, results: list, console: Console | None = None, *,
                  labels: dict[str, str] | None = None) -> None:
    """Every result's checks and effects, then the conformance matrix (:func:`matrix_table`: scenario x
    transfer mode x vLLM release x target; ``labels``: as there) and the overall line."""
    console = console or make_console()
    for r in results:
        console.rule(f"{r.scenario} / {r.target} ({r.incident}; vLLM {r.vllm_release})")
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
    if results:
        console.print(matrix_table(results, labels=labels))
    console.print(f"overall: {_verdict(report.get('verdict', 'UNKNOWN'))} ({report.get('status')}) - report {report.get('report_path')}")


def _targets(results: list) -> list[str]:
    return sorted({r.target for r in results}, key=lambda t: (t != "leasekit", t))


def matrix_rows(results: list) -> list[dict]:
    """The conformance matrix of ``results`` (:class:`leasekit.chaos.result.ScenarioResult`): one row per
    pair file, scenario, transfer mode and vLLM release, in the order they first ran, as ``{"scenario",
    "mode", "vllm_release", "pair_file", "incident", "targets": {target: {"verdict", "expected"}}}``
    (``report.json``'s ``matrix_rows``; the terminal table prints the same rows)."""
    rows: dict[tuple, dict] = {}
    for r in results:
        key = (r.pair_file, r.scenario, r.mode, r.vllm_release)
        row = rows.setdefault(key, {"scenario": r.scenario, "mode": r.mode, "vllm_release": r.vllm_release,
                                    "pair_file": r.pair_file, "incident": r.incident, "targets": {}})
        row["targets"][r.target] = {"verdict": r.verdict, "expected": r.expected}
    return list(rows.values())


def pair_file_label(pair_file: str | None, labels: dict[str, str] | None = None) -> str:
    """How the matrix and JUnit name a result's pair file: its label in ``labels`` (pair file as given ->
    a unique label; a run over several pair files passes each file's sub-directory name, ``01-cpu-local``),
    else the path as given (``"default"`` for none). Not the file's base name: two files may share one."""
    if pair_file is None:
        return "default"
    return (labels or {}).get(pair_file, pair_file)


def matrix_table(results: list, *, labels: dict[str, str] | None = None) -> Table:
    """The terminal conformance matrix: scenario, mode, vLLM (the release the pair reported), the pair
    file (only when several ran; :func:`pair_file_label` with ``labels``), incident, then a column per
    target; the expected verdict in brackets when the verdict differs."""
    rows = matrix_rows(results)
    targets = _targets(results)
    several = len({row["pair_file"] for row in rows}) > 1
    table = Table(title="conformance: verdict per scenario, transfer mode, vLLM release and target "
                        "(expected in brackets when different)", title_justify="left")
    for column in ("scenario", "mode", "vLLM", *(("pair file",) if several else ()), "incident", *targets):
        table.add_column(column)
    for row in rows:
        cells = []
        for target in targets:
            cell = row["targets"].get(target)
            if cell is None:
                cells.append("-")
                continue
            text = _verdict(cell["verdict"])
            cells.append(text if cell["verdict"] == cell["expected"] else f"{text} [{cell['expected']}]")
        pair = (pair_file_label(row["pair_file"], labels),) if several else ()
        table.add_row(row["scenario"], row["mode"], row["vllm_release"], *pair, row["incident"], *cells)
    return table


def junit_verdict(result) -> str:
    """The JUnit outcome is keyed on the expectation, so CI's colour matches the exit code: an
    expected verdict passes (an expected UNKNOWN is "skipped"); an unexpected FAIL or PASS is a
    failure; a harness error or an unexpected UNKNOWN is an error."""
    if result.as_expected:
        return UNKNOWN if result.verdict == UNKNOWN else "PASS"
    if result.summary.startswith("harness error"):
        return "HARNESS ERROR"
    return "UNEXPECTED UNKNOWN" if result.verdict == UNKNOWN else FAIL


def junit_cases(results: list, *, labels: dict[str, str] | None = None) -> list[JUnitCase]:
    """One JUnit test case per result: name the scenario, classname the target, properties
    ``transfer_mode``, ``vllm_release`` and (when set) ``pair_file``. ``labels`` (pair file as given -> a
    unique label; given when several pair files ran): the name also carries the pair file's label
    (:func:`pair_file_label`) and the release (``kill-decode [02-vllm-033, vLLM 0.33.0]``), so no two cases
    share a name and classname, even for two pair files with one base name."""
    cases = []
    for r in results:
        name = r.scenario if labels is None else f"{r.scenario} [{pair_file_label(r.pair_file, labels)}, vLLM {r.vllm_release}]"
        cases.append(JUnitCase(
            name=name, target=r.target, verdict=junit_verdict(r), duration_s=r.duration_s,
            bound=next((c.details.get("bound") for c in r.checks if c.details.get("bound")), None),
            measured=next((c.details.get("min_margin_s") for c in r.checks if c.details.get("min_margin_s") is not None), None),
            reason=f"{r.verdict} (expected {r.expected}): {r.summary}"
                   + (f" [known defect: {r.known_defect}]" if r.known_defect and r.expected == FAIL else ""),
            evidence="\n".join(f"{c.name}: {c.verdict} - {c.summary}" for c in r.checks),
            properties={"transfer_mode": r.mode, "vllm_release": r.vllm_release, "pair_file": r.pair_file or ""},
        ))
    return cases
