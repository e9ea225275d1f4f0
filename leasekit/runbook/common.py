"""Helpers shared by the runbook commands: exit codes, argument types, time and output formatting."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNKNOWN = 0, 1, 2, 3
"""Exit codes, the same meanings as ``leasekit chaos run`` (:mod:`leasekit.cli`): 0 all good,
1 a known problem, 2 bad usage, 3 unknown (could not tell)."""


def seconds_type(low: float, high: float, *, low_inclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type=`` that parses seconds in ``(low, high]`` (``[low, high]`` if inclusive).

    Raises (from the returned parser):
        argparse.ArgumentTypeError: not a number, nan/inf, or outside the range; argparse turns it
            into a usage error (exit 2).
    """
    relation = "<=" if low_inclusive else "<"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds as a number, got {text!r}") from None
        ok = (value >= low if low_inclusive else value > low) and value <= high
        if not ok:  # refuses nan and inf too
            raise argparse.ArgumentTypeError(f"must satisfy {low} {relation} seconds <= {high}, got {text}")
        return value

    return parse


def wall_time(unix_ns: int | None) -> str | None:
    """Wall-clock nanoseconds since the epoch as ISO-8601 UTC with microseconds; None stays None."""
    if unix_ns is None or unix_ns <= 0:
        return None
    stamp = dt.datetime.fromtimestamp(unix_ns / 1e9, tz=dt.UTC)
    return stamp.isoformat(timespec="microseconds").replace("+00:00", "Z")


def fmt_num(value: Any, digits: int = 3) -> str:
    """A number for a table cell: integers without decimals, floats with ``digits`` decimals,
    None as ``-``; anything else via ``str``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if float(value).is_integer():
            return str(int(value))
        return f"{value:.{digits}f}"
    return str(value)


def fmt_seconds(value: float | None, *, signed: bool = False) -> str:
    """Seconds with millisecond precision and an ``s`` unit (``+1.234 s`` if ``signed``); None is ``-``."""
    if value is None:
        return "-"
    return f"{value:+.3f} s" if signed else f"{value:.3f} s"


def fmt_mapping(mapping: dict[str, Any]) -> str:
    """``{"a": 1, "b": 2}`` as ``a=1, b=2`` (``-`` when empty)."""
    return ", ".join(f"{k}={fmt_num(v)}" for k, v in mapping.items()) or "-"


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout (keys in insertion order: callers build them stably)."""
    print(json.dumps(data, indent=2, default=str))


def console() -> Console:
    """A rich console on the current ``sys.stdout`` (so redirection and test capture work), at least
    120 columns wide so tables are not squeezed when stdout is not a terminal."""
    return Console(file=sys.stdout, width=max(120, Console(file=sys.stdout).width), soft_wrap=True)


def key_value_table(title: str, rows: Iterable[tuple[str, Any]]) -> Table:
    """A two-column (quantity, value) table; values formatted with :func:`fmt_num`."""
    table = Table(title=title, title_justify="left")
    table.add_column("quantity", no_wrap=True)
    table.add_column("value")
    for key, value in rows:
        table.add_row(escape(key), escape(value if isinstance(value, str) else fmt_num(value)))
    return table


def error(message: str) -> None:
    """Print ``leasekit: <message>`` on stderr."""
    print(f"leasekit: {message}", file=sys.stderr)
