"""The ``leasekit`` runbook commands.

``leasekit chaos list`` lists the scenario catalog; ``leasekit chaos run NAME`` runs a scenario
against a freshly started real P/D pair and exits 0 only on PASS; ``leasekit bounds`` prints the
bounds for a lease duration.
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
from leasekit.lease.config import LeaseConfigError, LeaseTiming

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds as a number, got {text!r}") from None
    if not value > 0 or value > 3600:
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 3600 seconds, got {text}")
    return int(value) if value.is_integer() else value


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
    report = ScenarioRun(scenario, run_dir, start_timeout_s=args.start_timeout).execute()
    if report["status"] == "interrupted":
        return 130
    return EXIT_OK if report["verdict"] == "PASS" else EXIT_FAIL


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
    p_run.add_argument("--tick", type=float, help="override the allowance for P's step period (seconds)")
    p_run.add_argument("--prefill-connector", choices=("leasekit", "stock"))
    p_run.add_argument("--decode-connector", choices=("leasekit", "stock"))
    p_run.add_argument("--run-dir", help="where logs, spans and report.json go (default runs/<time>-<name>)")
    p_run.add_argument("--catalog", help="scenario directory")
    p_run.add_argument("--start-timeout", type=float, default=300.0, help="seconds each server may take to start")
    p_run.set_defaults(func=_cmd_chaos_run)

    p_bounds = sub.add_parser("bounds", help="print the reclaim bound, safe stall and loss budget")
    p_bounds.add_argument("--lease-duration", type=_positive_seconds, default=30)
    p_bounds.add_argument("--tick", type=float, default=0.1, help="P's step period (seconds)")
    p_bounds.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p_bounds.set_defaults(func=_cmd_bounds)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``leasekit`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
