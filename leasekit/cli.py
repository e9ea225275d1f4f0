"""The ``leasekit`` runbook commands.

``leasekit chaos list`` lists the scenario catalog; ``leasekit chaos run NAME`` runs a scenario
against a freshly started real P/D pair; ``leasekit bounds`` prints the bounds for a lease duration.

Exit codes of ``chaos run``: 0 the verdict is the scenario's expected one (PASS for kill-decode),
1 FAIL, 3 UNKNOWN, 4 the harness failed (servers did not start, ...), 2 bad usage,
130 interrupted by SIGINT, 143 by SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leasekit.chaos.scenario import ScenarioError, catalog_dir, find_scenario, list_scenarios, load_scenario
from leasekit.lease.bounds import loss_budget, safe_stall_s
from leasekit.lease.config import LeaseConfigError, LeaseTiming, lint_timing

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNKNOWN, EXIT_HARNESS = 0, 1, 2, 3, 4
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


def _seconds(low: float, high: float, *, low_inclusive: bool) -> "argparse._TypeFunc":  # type: ignore[name-defined]
    relation = "<=" if low_inclusive else "<"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds as a number, got {text!r}") from None
        ok = (value >= low if low_inclusive else value > low) and value <= high
        if not ok:  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"must satisfy {low} {relation} seconds <= {high}, got {text}")
        return int(value) if value.is_integer() else value

    return parse


_positive_seconds = _seconds(0, 3600, low_inclusive=False)
_tick_seconds = _seconds(0, 60, low_inclusive=True)
_start_timeout_seconds = _seconds(0, 3600, low_inclusive=False)


def _writable_dir(path: Path) -> str | None:
    """None if ``path`` can be created and written, else the reason."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".leasekit-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _cmd_chaos_list(args: argparse.Namespace) -> int:
    table = Table(title=f"scenarios in {args.catalog or catalog_dir()}")
    for column in ("name", "incident", "L (s)", "description"):
        table.add_column(column)
    for name, path in list_scenarios(Path(args.catalog) if args.catalog else None).items():
        try:
            s = load_scenario(path)
            table.add_row(name, s.incident, str(s.lease.duration_s), s.description)
        except ScenarioError as exc:
            table.add_row(name, "?", "?", f"[red]invalid: {exc}[/]")
    Console().print(table)
    return EXIT_OK


def _cmd_chaos_run(args: argparse.Namespace) -> int:
    from leasekit.chaos.runner import ScenarioRun  # imports the cluster stack only when running

    catalog = Path(args.catalog) if args.catalog else None
    try:
        scenario = find_scenario(args.name, catalog).with_overrides(
            lease_duration_s=args.lease_duration, tick_s=args.tick,
            prefill_connector=args.prefill_connector, decode_connector=args.decode_connector,
        )
    except ScenarioError as exc:
        print(f"leasekit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"{stamp}-{scenario.name}"
    problem = _writable_dir(run_dir)
    if problem:
        print(f"leasekit: --run-dir {run_dir} is not a writable directory ({problem})", file=sys.stderr)
        return EXIT_USAGE
    run = ScenarioRun(scenario, run_dir, start_timeout_s=args.start_timeout)
    report = run.execute()
    if report["status"] == "interrupted":
        return EXIT_SIGTERM if run.interrupt_signal == "SIGTERM" else EXIT_SIGINT
    if report["status"] != "completed":
        return EXIT_HARNESS
    if report["as_expected"]:
        return EXIT_OK
    return {"FAIL": EXIT_FAIL, "UNKNOWN": EXIT_UNKNOWN}.get(report["verdict"], EXIT_FAIL)


def _cmd_bounds(args: argparse.Namespace) -> int:
    try:
        timing = LeaseTiming.from_lease_duration(args.lease_duration)
    except LeaseConfigError as exc:
        print(f"leasekit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        budget: int | str = loss_budget(timing)
    except LeaseConfigError as exc:
        budget = f"undefined ({exc})"
    data = {
        "lease_duration_s": timing.lease_duration_s,
        "heartbeat_interval_s": timing.heartbeat_interval_s,
        "extension_s": timing.extension_s,
        "tick_s": args.tick,
        "reclaim_bound": f"max(grant + {timing.lease_duration_s}, last_heartbeat + {timing.extension_s}) + {args.tick} s",
        "reclaim_after_silence_worst_case_s": max(timing.lease_duration_s, timing.extension_s) + args.tick,
        "safe_stall_s": safe_stall_s(timing),
        "heartbeat_loss_budget": budget,
        "lint": lint_timing(timing),
    }
    if args.output == "json":
        print(json.dumps(data, indent=2))
    else:
        table = Table(title=f"lease bounds for kv_lease_duration={timing.lease_duration_s} s")
        table.add_column("quantity")
        table.add_column("value")
        for key, value in data.items():
            table.add_row(key, str(value))
        Console().print(table)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``leasekit`` command."""
    parser = argparse.ArgumentParser(prog="leasekit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    chaos = sub.add_parser("chaos", help="chaos scenarios against a real P/D pair")
    chaos_sub = chaos.add_subparsers(dest="chaos_command", required=True)
    p_list = chaos_sub.add_parser("list", help="list the scenario catalog")
    p_list.add_argument("--catalog", help="scenario directory (default: chaos/ or $LEASEKIT_CHAOS_DIR)")
    p_list.set_defaults(func=_cmd_chaos_list)
    p_run = chaos_sub.add_parser("run", help="run one scenario; exit 0 only on PASS")
    p_run.add_argument("name", help="scenario name from the catalog, or a path to a .toml file")
    p_run.add_argument("--lease-duration", type=_positive_seconds, help="override kv_lease_duration (seconds)")
    p_run.add_argument("--tick", type=_tick_seconds, help="override the allowance for P's step period (0-60 s)")
    p_run.add_argument("--prefill-connector", choices=("leasekit", "stock"))
    p_run.add_argument("--decode-connector", choices=("leasekit", "stock"))
    p_run.add_argument("--run-dir", help="where logs, spans and report.json go (default runs/<time>-<name>)")
    p_run.add_argument("--catalog", help="scenario directory")
    p_run.add_argument("--start-timeout", type=_start_timeout_seconds, default=300.0,
                       help="seconds each server may take to start (default 300)")
    p_run.set_defaults(func=_cmd_chaos_run)

    p_bounds = sub.add_parser("bounds", help="print the reclaim bound, safe stall and loss budget")
    p_bounds.add_argument("--lease-duration", type=_positive_seconds, default=30)
    p_bounds.add_argument("--tick", type=_tick_seconds, default=0.1, help="P's step period (0-60 s)")
    p_bounds.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p_bounds.set_defaults(func=_cmd_bounds)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``leasekit`` console script; returns the exit code."""
    import signal

    # A shell may start a background job with SIGINT ignored; Ctrl-C / kill -INT must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
