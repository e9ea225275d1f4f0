"""The ``leasekit`` runbook commands.

``leasekit chaos list`` lists the scenario catalog; ``leasekit chaos run NAME...|--all`` runs
scenarios against real P/D pairs, once per target (LeaseKitConnector, stock NixlConnector);
``leasekit bounds`` prints the bounds for a lease duration; ``leasekit status URL...`` reads lease
health from servers' ``/metrics``; ``leasekit explain REQUEST_ID`` prints a lease's timeline from its
spans; ``leasekit lint --kv-transfer-config JSON`` checks a lease config; ``leasekit dashboards build
[--check]`` generates the Grafana dashboard and Prometheus rules in ``dashboards/``.

Exit codes of ``chaos run``: 0 every verdict is the scenario's expected one (kill-decode expects
PASS on both targets), 1 an unexpected FAIL (or a PASS where a known defect was expected: the
scenario file needs updating), 3 an unexpected UNKNOWN, 4 a harness error (a pair that would not
start, a fault that could not be set up, a teardown that failed), 2 bad usage (or a pair file its hosts
refuse, found before anything starts), 130 interrupted
by SIGINT, 143 by SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from leasekit.chaos.catalogcli import catalog_problem as _catalog_problem
from leasekit.chaos.catalogcli import cmd_chaos_list as _cmd_chaos_list
from leasekit.chaos.scenario import ScenarioError, find_scenario, list_scenarios
from leasekit.lease.bounds import loss_budget, safe_stall_s
from leasekit.lease.config import LeaseConfigError, LeaseTiming, lint_timing
from leasekit.runbook.common import seconds_type

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNKNOWN, EXIT_HARNESS = 0, 1, 2, 3, 4
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


def _seconds(low: float, high: float, *, low_inclusive: bool) -> Callable[[str], float]:
    """:func:`leasekit.runbook.common.seconds_type`, keeping whole numbers ``int`` (``L = 6`` stays
    int, as vLLM's floor division ``H = L // 6`` needs)."""
    parse = seconds_type(low, high, low_inclusive=low_inclusive)

    def whole(text: str) -> float:
        value = parse(text)
        return int(value) if value.is_integer() else value

    return whole


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


def _load_pairs(args: argparse.Namespace) -> list[tuple]:
    """``[(pair file path or None, PairFile or None, lease duration override or None)]``, one per ``--pair``
    (repeatable) in the order given, or one ``(None, None, --lease-duration)`` without it; ``--lease-duration``
    wins over each file's ``lease_duration_s``.

    Raises:
        leasekit.cluster.pairfile.PairFileError: a file is missing or invalid, or given twice.
    """
    if not args.pair:
        return [(None, None, args.lease_duration)]
    from leasekit.cluster.pairfile import PairFileError, load_pair_file

    out = []
    for path in args.pair:
        if any(Path(path).resolve() == Path(seen).resolve() for seen, _, _ in out):
            raise PairFileError(f"--pair {path}: given twice; fix: name each pair file once")
        deployment = load_pair_file(path)
        duration = args.lease_duration if args.lease_duration is not None else deployment.lease_duration_s
        out.append((path, deployment, int(duration) if duration is not None and float(duration).is_integer() else duration))
    return out


def _check_hosts(deployment, runs) -> str | None:
    """None when every server of ``deployment`` can start (this machine, or SSH support) and the
    hosts pass preflight (model, GPUs, cores, tools the ``runs`` need); else the reason."""
    from leasekit.chaos.plan import tools_needed
    from leasekit.cluster.deploy import require_local
    from leasekit.cluster.pairfile import PairFileError
    from leasekit.cluster.preflight import preflight

    try:
        require_local(deployment)
        preflight(deployment, tools=tools_needed(runs))
    except PairFileError as exc:
        return str(exc)
    return None


def _cmd_chaos_run(args: argparse.Namespace) -> int:
    from leasekit.chaos.suite import Suite, plan  # imports the cluster stack only when running
    from leasekit.cluster.pairfile import PairFileError

    catalog = Path(args.catalog) if args.catalog else None
    if not args.names and not args.all:
        print("leasekit: name one or more scenarios, or pass --all (see `leasekit chaos list`)", file=sys.stderr)
        return EXIT_USAGE
    if args.names and args.all:
        print("leasekit: pass scenario names or --all, not both", file=sys.stderr)
        return EXIT_USAGE
    if args.output != "text" and not args.plan:
        print(f"leasekit: -o/--output {args.output} formats the plan: pass it with --plan (a run writes report.json "
              "in its run directory)", file=sys.stderr)
        return EXIT_USAGE
    duplicates = sorted({n for n in args.names if args.names.count(n) > 1})
    if duplicates:
        print(f"leasekit: scenario(s) named twice: {', '.join(duplicates)}", file=sys.stderr)
        return EXIT_USAGE
    if (problem := _catalog_problem(catalog)):
        print(f"leasekit: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        pairs = _load_pairs(args)
    except PairFileError as exc:
        print(f"leasekit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _, deployment, lease_duration = pairs[0]
    try:
        names = list(list_scenarios(catalog)) if args.all else args.names
        if not names:
            print(f"leasekit: no scenario files (*.toml) in {catalog}", file=sys.stderr)
            return EXIT_USAGE
        scenarios = [
            find_scenario(name, catalog).with_overrides(lease_duration_s=lease_duration, tick_s=args.tick)
            for name in names
        ]
    except ScenarioError as exc:
        print(f"leasekit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if len({s.name for s in scenarios}) != len(scenarios):
        print("leasekit: two scenarios have the same name", file=sys.stderr)
        return EXIT_USAGE
    if lease_duration is not None:  # --lease-duration, or the pair file's lease_duration_s
        source = f"--lease-duration {args.lease_duration:g}" if args.lease_duration is not None else \
            f"the pair file's lease_duration_s = {lease_duration:g}"
        for finding in lint_timing(scenarios[0].lease.timing()):
            print(f"leasekit: warning: {source}: {finding}", file=sys.stderr)
        t = scenarios[0].lease.timing()
        print(f"leasekit: lease-relative scenario times resolved at L = {t.lease_duration_s:g} s (H = "
              f"{t.heartbeat_interval_s:g} s, E = {t.extension_s:g} s); times written as plain numbers stay seconds",
              file=sys.stderr)
    runs = plan(scenarios, args.target)
    if not runs:
        print(f"leasekit: none of the scenarios runs on target(s) {', '.join(args.target or [])}", file=sys.stderr)
        return EXIT_USAGE
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    label = "all" if args.all else "-".join(s.name for s in scenarios)[:80]
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"{stamp}-{label}"
    if getattr(args, "testbed", None):
        if args.pair or args.plan:
            print("leasekit: --testbed builds its own pair file: pass it without --pair and --plan", file=sys.stderr)
            return EXIT_USAGE
        return _run_on_testbed(args, runs, run_dir)
    if args.plan and len(pairs) > 1:
        print("leasekit: --plan takes one --pair; print each pair file's plan on its own", file=sys.stderr)
        return EXIT_USAGE
    if len(pairs) > 1:
        return _run_pair_files(args, names, pairs, run_dir)
    if args.plan:  # every command the run would execute; nothing is executed or created
        from leasekit.chaos.plan import build_plan

        from leasekit.chaos.faults import FaultError

        try:
            built = build_plan(runs, deployment, run_dir)
        except (ValueError, FaultError) as exc:  # the run would refuse it too: a message, no traceback
            print(f"leasekit: cannot plan this run: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(json.dumps(built.to_json(), indent=2) if args.output == "json" else built.text(), end="" if args.output != "json" else "\n")
        return EXIT_OK
    if deployment is not None and (problem := _check_hosts(deployment, runs)):
        print(f"leasekit: {problem}", file=sys.stderr)
        return EXIT_USAGE
    problem = _writable_dir(run_dir)
    if problem:
        print(f"leasekit: --run-dir {run_dir} is not a writable directory ({problem})", file=sys.stderr)
        return EXIT_USAGE
    suite = Suite(runs, run_dir, start_timeout_s=args.start_timeout, deployment=deployment, pair_file=pairs[0][0])
    return _suite_exit(suite, suite.execute())


def _run_pair_files(args: argparse.Namespace, names: list[str], pairs: list[tuple], run_dir: Path) -> int:
    """Several ``--pair`` files: plan the scenarios ``names`` for each (at its lease duration), check every
    file's hosts before anything starts, then run them in turn (:class:`leasekit.chaos.multipair.PairFileRuns`)."""
    from leasekit.chaos.multipair import PairFileRuns
    from leasekit.chaos.suite import plan

    catalog = Path(args.catalog) if args.catalog else None
    entries = []
    for path, deployment, duration in pairs:
        try:
            scenarios = [find_scenario(n, catalog).with_overrides(lease_duration_s=duration, tick_s=args.tick) for n in names]
        except ScenarioError as exc:
            print(f"leasekit: --pair {path}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        runs = plan(scenarios, args.target)
        if (problem := _check_hosts(deployment, runs)):
            print(f"leasekit: --pair {path}: {problem}", file=sys.stderr)
            return EXIT_USAGE
        entries.append((path, deployment, runs))
    if (problem := _writable_dir(run_dir)):
        print(f"leasekit: --run-dir {run_dir} is not a writable directory ({problem})", file=sys.stderr)
        return EXIT_USAGE
    multi = PairFileRuns(entries, run_dir, start_timeout_s=args.start_timeout)
    return _suite_exit(multi, multi.execute())


def _suite_exit(suite, report: dict) -> int:
    if report["status"] == "interrupted":
        return EXIT_SIGTERM if suite.interrupt_signal == "SIGTERM" else EXIT_SIGINT
    if report["status"] != "completed" or report["harness_errors"]:
        return EXIT_HARNESS
    return {"PASS": EXIT_OK, "FAIL": EXIT_FAIL}.get(report["verdict"], EXIT_UNKNOWN)


def _run_on_testbed(args: argparse.Namespace, runs, run_dir: Path) -> int:
    """``--testbed two-hosts``: build the two SSH hosts and their pair file in ``run_dir``, run the
    suite on it, tear everything down (also on Ctrl-C / SIGTERM)."""
    from leasekit.chaos.suite import Suite, interrupts_as_keyboard_interrupt
    from leasekit.cluster.twohosts import TwoHostDeployment

    problem = _writable_dir(run_dir)
    if problem:
        print(f"leasekit: --run-dir {run_dir} is not a writable directory ({problem})", file=sys.stderr)
        return EXIT_USAGE
    with interrupts_as_keyboard_interrupt(), TwoHostDeployment(run_dir) as testbed:  # Ctrl-C, SIGTERM: torn down
        print(f"leasekit: two SSH hosts up ({testbed.testbed.address('prefill')}, {testbed.testbed.address('decode')}); "
              f"pair file {testbed.pair_path}", file=sys.stderr)
        if (problem := _check_hosts(testbed.pair, runs)):
            print(f"leasekit: {problem}", file=sys.stderr)
            return EXIT_USAGE
        suite = Suite(runs, run_dir, start_timeout_s=args.start_timeout, deployment=testbed.pair)
        report = suite.execute()
    return _suite_exit(suite, report)


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
    parser = argparse.ArgumentParser(prog="leasekit", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)

    chaos = sub.add_parser("chaos", help="chaos scenarios against a real P/D pair")
    chaos_sub = chaos.add_subparsers(dest="chaos_command", required=True)
    p_list = chaos_sub.add_parser("list", help="list the scenario catalog")
    p_list.add_argument("--catalog", help="scenario directory (default: chaos/ or $LEASEKIT_CHAOS_DIR)")
    p_list.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p_list.set_defaults(func=_cmd_chaos_list)
    p_run = chaos_sub.add_parser(
        "run", help="run scenarios against real P/D pairs; exit 0 only when every verdict is the expected one")
    p_run.add_argument("names", nargs="*", metavar="NAME", help="scenario names from the catalog, or paths to .toml files")
    p_run.add_argument("--all", action="store_true", help="run the whole catalog")
    p_run.add_argument("--target", action="append", choices=("leasekit", "stock"),
                       help="run only against this target (repeatable; default: the targets each scenario lists)")
    p_run.add_argument("--lease-duration", type=_positive_seconds, help="override kv_lease_duration (seconds)")
    p_run.add_argument("--tick", type=_tick_seconds, help="override the allowance for P's step period (0-60 s)")
    p_run.add_argument("--run-dir", help="where logs, spans and report.json go (default runs/<time>-<name>)")
    p_run.add_argument("--catalog", help="scenario directory")
    p_run.add_argument("--start-timeout", type=_start_timeout_seconds, default=300.0,
                       help="seconds each server may take to start (default 300)")
    p_run.add_argument("--pair", metavar="FILE", action="append",
                       help="a pair file (pairs/*.toml): hosts, devices, model, TP, ports, vLLM interpreter of the P/D pair "
                            "to start (default: the CPU pair, pairs/cpu-local.toml); repeatable: the scenarios run against "
                            "each file in turn, each in <run dir>/<NN>-<file stem>/, one matrix over all")
    p_run.add_argument("--testbed", choices=("two-hosts",),
                       help="two-hosts: build two SSH hosts on this machine (a network namespace and an sshd each, keys "
                            "made for the run), write their pair file into the run dir, run P on one and D on the other, "
                            "tear it all down (needs root, ip, nft, sshd)")
    p_run.add_argument("--plan", action="store_true",
                       help="print every command the run would execute, per host, and exit; nothing is executed")
    p_run.add_argument("-o", "--output", choices=("text", "json"), default="text", help="format of --plan")
    p_run.set_defaults(func=_cmd_chaos_run)

    p_bounds = sub.add_parser("bounds", help="print the reclaim bound, safe stall and loss budget")
    p_bounds.add_argument("--lease-duration", type=_positive_seconds, default=30)
    p_bounds.add_argument("--tick", type=_tick_seconds, default=0.1, help="P's step period (0-60 s)")
    p_bounds.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p_bounds.set_defaults(func=_cmd_bounds)

    from leasekit.runbook import register_all  # status, explain, lint

    register_all(sub)
    from leasekit.dashboards import register as register_dashboards  # dashboards build [--check]

    register_dashboards(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``leasekit`` console script; returns the exit code."""
    import signal

    # A shell may start a background job with SIGINT ignored; Ctrl-C / kill -INT must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `leasekit status ... -o json | head`: the reader left; not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so the interpreter's flush at exit is quiet
        except OSError:
            pass
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
