"""``leasekit chaos list``: the scenario catalog as a table or JSON, and the catalog directory check the
chaos commands share."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from leasekit.chaos.scenario import CATALOG_ENV, ScenarioError, catalog_dir, list_scenarios, load_scenario

EXIT_OK, EXIT_USAGE = 0, 2  # leasekit.cli's codes (leasekit.runbook is a layer above: not imported)


def catalog_problem(catalog: str | Path | None) -> str | None:
    """Why the scenario directory (``--catalog``, else ``$LEASEKIT_CHAOS_DIR``) cannot be used, or None."""
    if catalog is not None:
        return None if Path(catalog).is_dir() else f"--catalog {catalog} is not a directory"
    configured = os.environ.get(CATALOG_ENV)
    if configured and not Path(configured).is_dir():
        return (f"{CATALOG_ENV}={configured} is not a directory; fix: point it at a directory of scenario files, "
                "or unset it for the built-in catalog")
    return None


def cmd_chaos_list(args: argparse.Namespace) -> int:
    """``leasekit chaos list [--catalog DIR] [-o table|json]``: every scenario file with its incident, L, mode,
    targets, expected verdicts and description, or the error that makes it invalid. Exit 0 when every file
    loads, 2 when one does not (or the catalog is not a directory): a catalog check for CI."""
    if (problem := catalog_problem(args.catalog)):
        print(f"leasekit: {problem}", file=sys.stderr)
        return EXIT_USAGE
    rows = []
    for name, path in list_scenarios(Path(args.catalog) if args.catalog else None).items():
        try:
            s = load_scenario(path)
            rows.append({"name": name, "incident": s.incident, "lease_duration_s": s.lease.duration_s,
                         "mode": s.topology.transfer_mode, "targets": list(s.topology.targets), "expect": {t: s.expect.verdict_for(t) for t in s.topology.targets},
                         "description": s.description, "path": str(path)})
        except ScenarioError as exc:
            rows.append({"name": name, "path": str(path), "error": str(exc)})
    invalid = EXIT_USAGE if any("error" in row for row in rows) else EXIT_OK  # a catalog check for CI
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return invalid
    table = Table(title=f"scenarios in {args.catalog or catalog_dir()}")
    for column in ("name", "incident", "L (s)", "mode", "targets"):  # never cut: names are what you type next
        table.add_column(column, no_wrap=True)
    table.add_column("expect")
    table.add_column("description", overflow="fold")
    for row in rows:
        if "error" in row:
            table.add_row(Text(row["name"]), "?", "?", "?", "?", "?", Text(f"invalid: {row['error']}", style="red"))
            continue
        expect = ", ".join(f"{t}: {v}" for t, v in row["expect"].items())
        table.add_row(*(Text(cell) for cell in (row["name"], row["incident"], f'{row["lease_duration_s"]:g}', row["mode"],
                                                ",".join(row["targets"]), expect, row["description"])))  # Text: a file's [brackets] are not markup
    console = Console()
    if not console.is_terminal:  # a pipe or file: rich would assume 80 columns
        console = Console(width=200)
    console.print(table)
    return invalid
