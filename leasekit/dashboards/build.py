"""``leasekit dashboards build [--check] [--out DIR]``: write the generated dashboard and rule
file, or check that the committed ones are current and read only exported metrics (the pattern of
vLLM's ``tools/generate_grafana_dashboards.py --check``).

Exit codes: 0 written / up to date; 1 a generated expression reads a metric the connector does
not export (nothing is written), a committed file is stale or missing (``--check``), or a
promtool test file feeds a series that is not exported; 2 bad usage.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import TextIO

import yaml

from leasekit.dashboards import rules
from leasekit.dashboards.checks import dashboard_problems, promtool_test_problems, rules_problems

DASHBOARD_FILE = "lease-health.json"
"""The generated dashboard's file name (:data:`leasekit.dashboards.lease_health.FILE_NAME`; kept
here so registering the CLI command does not import grafana-foundation-sdk)."""

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DIFF_LINES = 40
"""At most this many diff lines are printed per stale file."""


def default_out_dir() -> Path:
    """``dashboards/`` of the repository this package sits in (as
    :func:`leasekit.chaos.scenario.catalog_dir` finds ``chaos/``)."""
    return Path(__file__).resolve().parents[2] / "dashboards"


def render_dashboard(dashboard: object) -> str:
    """A dashboard (SDK model or plain dict) as pretty JSON with sorted keys and a trailing
    newline: byte-identical for identical input."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return json.dumps(dashboard, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


def generate(config: rules.RulesConfig) -> dict[str, str]:
    """``{file name: text}`` of every generated file under ``dashboards/``."""
    from leasekit.dashboards import lease_health  # grafana-foundation-sdk: only when building

    assert lease_health.FILE_NAME == DASHBOARD_FILE
    return {
        DASHBOARD_FILE: render_dashboard(lease_health.dashboard(config.runbook_url).build()),
        rules.FILE_NAME: rules.render_yaml(rules.rules_document(config)),
    }


def problems(files: dict[str, str], out_dir: Path) -> list[str]:
    """Metric and structure problems of generated ``files`` and of the promtool tests in
    ``out_dir/tests/*.yml`` (see :mod:`leasekit.dashboards.checks`)."""
    found = dashboard_problems(json.loads(files[DASHBOARD_FILE]), DASHBOARD_FILE)
    rule_doc = yaml.safe_load(files[rules.FILE_NAME])
    found += rules_problems(rule_doc, rules.FILE_NAME)
    for test_file in sorted((out_dir / "tests").glob("*.yml")):
        found += promtool_test_problems(test_file, rule_doc)
    return found


def _stale(path: Path, expected: str) -> str | None:
    """Why the file at ``path`` is not ``expected`` (a diff excerpt), or None if it is."""
    try:
        actual = path.read_text()
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path} cannot be read: {exc}"
    if actual == expected:
        return None
    diff = list(difflib.unified_diff(actual.splitlines(), expected.splitlines(), f"{path} (committed)",
                                     f"{path} (generated)", lineterm="", n=1))
    shown = "\n".join(diff[:DIFF_LINES]) + (f"\n... ({len(diff) - DIFF_LINES} more diff lines)"
                                            if len(diff) > DIFF_LINES else "")
    return f"{path} is stale (differs from what leasekit/dashboards generates):\n{shown}"


def build(check: bool, out_dir: Path, config: rules.RulesConfig | None = None, *,
          out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Generate the dashboard and rule files into ``out_dir``, or with ``check`` compare them
    with the files there; returns the exit code (module docstring). Messages go to ``out`` /
    ``err`` (default stdout / stderr), each naming the file concerned.

    Raises:
        OSError: ``out_dir`` cannot be created or written (not with ``check``).
    """
    out, err = out or sys.stdout, err or sys.stderr
    config = config or rules.RulesConfig()
    files = generate(config)
    found = problems(files, out_dir)
    for problem in found:
        print(f"leasekit: {problem}", file=err)
    if found:
        print(f"leasekit: {len(found)} problem(s)" + ("" if check else "; nothing written"), file=err)
        return EXIT_FAIL
    if check:
        reasons = [r for name, text in files.items() if (r := _stale(out_dir / name, text))]
        for reason in reasons:
            print(f"leasekit: {reason}", file=err)
        if reasons:
            print("leasekit: regenerate with `leasekit dashboards build` (same options) and commit the result",
                  file=err)
            return EXIT_FAIL
        print(f"leasekit: {', '.join(sorted(files))} in {out_dir} are up to date", file=out)
        return EXIT_OK
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)
        print(f"leasekit: wrote {out_dir / name}", file=out)
    return EXIT_OK


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of blocks, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _runbook_url(text: str) -> str:
    """``--runbook-url``: an absolute http(s) URL of the runbook page, without an ``#anchor`` (alerts add one).

    Raises:
        argparse.ArgumentTypeError: anything else (the message names the expected form)."""
    if not text or "#" in text or not text.startswith(("http://", "https://")) or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected the runbook page's http(s) URL without an #anchor "
                                         f"(e.g. https://git.example/leasekit/docs/runbook.md), got {text!r}")
    return text


def _cmd_build(args: argparse.Namespace) -> int:
    out_dir = Path(args.out) if args.out else default_out_dir()
    if out_dir.exists() and not out_dir.is_dir():
        print(f"leasekit: --out {out_dir} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    config = rules.RulesConfig(runbook_url=args.runbook_url, pinned_blocks_high=args.pinned_blocks_high)
    try:
        return build(args.check, out_dir, config)
    except OSError as exc:
        print(f"leasekit: cannot write to {out_dir}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``dashboards build [--check] [--out DIR] [--runbook-url URL] [--pinned-blocks-high N]``
    to the ``leasekit`` parser's subcommands; the parsed namespace's ``func`` runs it and returns
    the exit code."""
    dashboards = subparsers.add_parser("dashboards", help="generate and check the Grafana dashboard and Prometheus rules")
    sub = dashboards.add_subparsers(dest="dashboards_command", required=True)
    p_build = sub.add_parser("build", help="write dashboards/*.json and the rule file, or --check them")
    p_build.add_argument("--check", action="store_true",
                         help="write nothing; exit 1 if a committed file is stale or reads an unexported metric")
    p_build.add_argument("--out", help="directory of the generated files (default: the repository's dashboards/)")
    p_build.add_argument("--runbook-url", type=_runbook_url, default=rules.DEFAULT_RUNBOOK_URL,
                         help=f"URL of docs/runbook.md the alerts link to (default {rules.DEFAULT_RUNBOOK_URL})")
    p_build.add_argument("--pinned-blocks-high", type=_positive_int, default=rules.DEFAULT_PINNED_BLOCKS_HIGH,
                         help="LeasePinnedBlocksHigh threshold in KV blocks per P server (default "
                              f"{rules.DEFAULT_PINNED_BLOCKS_HIGH}; about half the P engine's num_gpu_blocks)")
    p_build.set_defaults(func=_cmd_build)
