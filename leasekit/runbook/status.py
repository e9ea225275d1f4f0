"""``leasekit status URL...``: lease health of running vLLM servers from their ``/metrics``.

One scrape reports counters as totals since each server started; ``--interval S`` scrapes twice,
``S`` seconds apart, and reports increases and rates over that window (the verdict then uses the
increases, so an old incident no longer counts). Verdict rules: :mod:`leasekit.runbook.health`.

Exit codes: 0 every server OK; 1 any DEGRADED or CRITICAL (a known problem outranks an unknown,
as Jepsen's checker lets invalid outrank unknown); 3 otherwise if any server is UNREACHABLE,
UNKNOWN (answered, but not Prometheus text) or NO_LEASE_METRICS; 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import httpx
from rich.markup import escape
from rich.table import Table

from leasekit.runbook import health as h
from leasekit.runbook.common import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_UNKNOWN,
    EXIT_USAGE,
    console,
    error,
    fmt_mapping,
    fmt_num,
    key_value_table,
    print_json,
    seconds_type,
)
from leasekit.runbook.promscrape import Scrape, counter_deltas, metrics_url, scrape

DEFAULT_TIMEOUT_S = 5.0


def _empty_entry(url: str) -> dict[str, Any]:
    return {
        "url": url, "verdict": h.UNKNOWN, "reasons": [], "error": None, "notes": [],
        "config": {"kv_roles": [], "lease_duration_s": None, "heartbeat_interval_s": None, "extension_s": None},
        "gauges": {k: None for k in h.GAUGES},
        "counters": {k: None for k in (*h.COUNTERS, *h.VLLM_COUNTERS, *h.LISTENER_COUNTERS)},
        "breakdown": {k: {} for k in (*h.BREAKDOWNS, "handshake_bad_requests_by_reason")},
        "listener": {"up": None, "down_engines": []},
        "elapsed_s": None, "rates_per_s": None, "counter_resets": None, "ranks": [],
    }


def server_entry(first: Scrape, second: Scrape | None = None) -> dict[str, Any]:
    """One server's report from one scrape (totals) or two scrapes of it (increases between them).

    Returns:
        A dict with always the same keys: ``url, verdict, reasons, error, notes, config, gauges,
        counters, breakdown, listener, elapsed_s, rates_per_s, counter_resets, ranks`` (see
        :func:`leasekit.runbook.health.summarize`); values are None/empty where unknown, and
        ``elapsed_s`` (seconds between the two responses), ``rates_per_s`` and ``counter_resets`` are
        None for a single scrape.
    """
    entry = _empty_entry(first.url)
    failed = next((s for s in (first, second) if s is not None and s.error), None)
    if failed is not None:
        entry["verdict"] = h.UNKNOWN if failed.parse_error else h.UNREACHABLE
        which = "" if second is None else (" (first scrape)" if failed is first else " (second scrape)")
        entry["error"] = failed.error + which
        entry["reasons"] = [entry["error"]]
        return entry
    families = first.families if second is None else second.families
    if second is None:
        samples, window = first.samples, "since start"
    else:
        samples, resets = counter_deltas(first.samples, second.samples)
        elapsed = max(second.at_s - first.at_s, 1e-9)
        window = f"in the last {elapsed:.1f} s"
        entry["elapsed_s"], entry["counter_resets"] = elapsed, resets
    summary = h.summarize(samples, families)
    entry["verdict"], entry["reasons"] = h.verdict(summary, window=window)
    entry["notes"] = summary["notes"]
    for key in ("config", "gauges", "counters", "breakdown", "listener", "ranks"):
        entry[key] = summary[key]
    if second is not None:
        entry["rates_per_s"] = {k: v / entry["elapsed_s"] for k, v in summary["counters"].items()}
        if entry["counter_resets"]:
            entry["notes"].append(f"{entry['counter_resets']} counter series went down between the scrapes "
                                  "(server restarted?): their increase is taken as their new value")
    return entry


def collect_status(urls: list[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: float | None = None,
                   sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Scrape every server (twice, ``interval_s`` seconds apart, if given) and build the report.

    Args:
        urls: servers as accepted by :func:`leasekit.runbook.promscrape.metrics_url`.
        timeout_s: seconds for each scrape's whole answer (at most :data:`leasekit.runbook.promscrape.MAX_METRICS_BYTES`).
        interval_s: None for one scrape (totals), else seconds between the two scrapes (> 0).
        sleep: the sleep function (tests may pass a fake).

    Returns:
        ``{"mode": "totals"|"interval", "interval_s": S|None, "verdict": str, "servers": [entry]}``
        with entries from :func:`server_entry` in argument order; ``verdict`` is CRITICAL or DEGRADED
        if any server is, else UNKNOWN if any server is not OK, else OK. Never raises for a server.

    Raises:
        ValueError: a URL that is not a server address (:func:`leasekit.runbook.promscrape.metrics_url`).
    """
    targets = [metrics_url(u) for u in urls]
    with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
        first = [scrape(u, timeout_s=timeout_s, client=client) for u in targets]
        second = None
        if interval_s is not None:
            sleep(interval_s)
            second = [scrape(u, timeout_s=timeout_s, client=client) for u in targets]
    servers = [server_entry(a, None if second is None else second[i]) for i, a in enumerate(first)]
    verdicts = {s["verdict"] for s in servers}
    overall = next((v for v in (h.CRITICAL, h.DEGRADED) if v in verdicts), None)
    if overall is None:
        overall = h.OK if verdicts == {h.OK} else h.UNKNOWN
    return {"mode": "totals" if interval_s is None else "interval", "interval_s": interval_s,
            "verdict": overall, "servers": servers}


def exit_code(report: dict[str, Any]) -> int:
    """0 all OK; 1 any DEGRADED/CRITICAL; 3 otherwise any UNREACHABLE/UNKNOWN/NO_LEASE_METRICS."""
    verdicts = {s["verdict"] for s in report["servers"]}
    if verdicts & {h.CRITICAL, h.DEGRADED}:
        return EXIT_FAIL
    return EXIT_OK if verdicts <= {h.OK} else EXIT_UNKNOWN


def _count(entry: dict[str, Any], key: str) -> str:
    value = entry["counters"][key]
    if entry["rates_per_s"] is None or value is None:
        return fmt_num(value)
    return f"{fmt_num(value)} ({entry['rates_per_s'][key]:.3f}/s)"


def _server_rows(entry: dict[str, Any]) -> list[tuple[str, Any]]:
    cfg, g, b = entry["config"], entry["gauges"], entry["breakdown"]
    rows: list[tuple[str, Any]] = [
        ("verdict", entry["verdict"]),
        ("kv role(s)", ", ".join(cfg["kv_roles"]) or "-"),
        ("L / H / E", " / ".join(f"{fmt_num(cfg[k])} s" if cfg[k] is not None else "-"
                                 for k in ("lease_duration_s", "heartbeat_interval_s", "extension_s"))),
        ("leases active", g["leases_active"]), ("pinned KV blocks", g["pinned_blocks"]),
        ("leases expiring soon", g["expiring_soon"]),
    ]
    for key in ("grants", "extensions", "releases", "expiries"):
        rows.append((key, _count(entry, key)))
    for key in ("expired_peer_returns", "aborts", "late_completions", "heartbeats_sent", "heartbeat_send_failures", *h.VLLM_COUNTERS):
        rows.append((key.replace("_", " ") if not key.startswith("vllm:") else key, _count(entry, key)))
    rows += [("  " + key.replace("_", " "), fmt_mapping(b[key])) for key in h.BREAKDOWNS if b[key]]
    up = entry["listener"]["up"]
    rows.append(("handshake listener", "-" if up is None else "up" if up else
                 f"DOWN (engine {', '.join(entry['listener']['down_engines'])})"))
    rows += [("handshake requests", _count(entry, "handshake_requests")),
             ("bad handshake requests", _count(entry, "handshake_bad_requests"))]
    if b["handshake_bad_requests_by_reason"]:
        rows.append(("  by reason", fmt_mapping(b["handshake_bad_requests_by_reason"])))
    return rows


_RANK_COLUMNS = {"tp_rank": "rank", "leases_active": "active", "pinned_blocks": "pinned", "expiring_soon": "soon",
                 "extensions": "extends", "expired_peer_returns": "returns", "late_completions": "late", "heartbeats_sent": "hb sent",
                 "heartbeat_send_failures": "hb fail"}


def render_table(report: dict[str, Any]) -> None:
    """Print the report as tables: one per server, reasons and notes, per-rank rows where several."""
    out = console()
    if report["mode"] == "totals":
        window = "counters: totals since each server started (use --interval S for a window)"
    else:
        window = f"counters: increases over --interval {fmt_num(report['interval_s'])} s"
    out.print(window, markup=False)
    for entry in report["servers"]:
        if entry["error"]:
            out.print(f"[bold]{escape(entry['url'])}[/]: {entry['verdict']}: {escape(entry['error'])}")
            continue
        out.print(key_value_table(entry["url"], _server_rows(entry)))
        if entry["reasons"]:
            out.print(f"{entry['verdict']} because:")
        for reason in entry["reasons"]:
            out.print(f"  - {escape(reason)}")
        for note in entry["notes"]:
            out.print(f"  note: {escape(note)}")
        if len(entry["ranks"]) > 1:
            table = Table(title=f"{entry['url']} per rank", title_justify="left")
            keys = [k for k in entry["ranks"][0] if k not in ("engine", "tp_rank")]
            for column in ("engine", "tp_rank", *keys):
                table.add_column(_RANK_COLUMNS.get(column, column))
            for row in entry["ranks"]:
                table.add_row(escape(row["engine"]), escape(row["tp_rank"]), *(fmt_num(row[k]) for k in keys))
            out.print(table)
    out.print(f"overall: {report['verdict']}  ("
              + ", ".join(f"{s['url']}={s['verdict']}" for s in report["servers"]) + ")", markup=False)


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        report = collect_status(args.urls, timeout_s=args.timeout, interval_s=args.interval)
    except ValueError as exc:  # a URL that is no server address: checked before any scrape
        error(str(exc))
        return EXIT_USAGE
    if args.output == "json":
        print_json(report)
    else:
        render_table(report)
    return exit_code(report)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``status`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns its parser.

    The parser's ``func`` default is the handler: ``args.func(args)`` returns the exit code.
    """
    p = subparsers.add_parser(
        "status", help="lease health of running vLLM servers from their /metrics",
        description=(
            "Lease health of running vLLM servers from their /metrics. Exit codes: 0 every server OK; 1 any "
            "DEGRADED or CRITICAL; 3 otherwise any UNREACHABLE, UNKNOWN or NO_LEASE_METRICS; 2 bad usage."))
    p.add_argument("urls", nargs="+", metavar="URL", help="server URL, with or without /metrics (host:port works)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--timeout", type=seconds_type(0, 300), default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds for each scrape's whole answer (default {DEFAULT_TIMEOUT_S:g}; bodies over 16 MiB are refused)")
    p.add_argument("--interval", type=seconds_type(0, 3600), default=None, metavar="S",
                   help="scrape twice, S seconds apart, and report increases and rates (default: one scrape, totals)")
    p.set_defaults(func=_cmd_status)
    return p
