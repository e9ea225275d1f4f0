"""The report of the telemetry-overhead benchmark: what the result document derives from the
measurements (:func:`analyze`) and the human table printed at the end (:func:`format_table`). Pure:
no I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .spans import SpanPhase, merge_phases, span_volume_verdict
from .stats import HIGHER_IS_BETTER, METRICS, TARGETS, RunStats, ratios, target_summary
from .verdicts import GOAL_TOLERANCE, goal_verdict, metric_verdict


def analyze(runs: dict[str, Sequence[RunStats]], round_phases: Sequence[SpanPhase],
            queue_phases: Sequence[SpanPhase]) -> dict[str, Any]:
    """Everything the report derives from the measurements: per-target ``summary``, ``ratios``,
    per-metric ``verdicts`` (throughput and p99 decide the goal; tokens/s and p50 are informative),
    ``goal_verdict``, ``span_phases`` (each measured round, all rounds together, each queue phase)
    and ``span_volume``.

    ``runs`` maps both targets of :data:`.stats.TARGETS` to their measured rounds; ``round_phases``
    are the leasekit pair's span phases of the measured rounds, ``queue_phases`` those of the queue
    phases. Returns the keys above as JSON-ready values (verdicts as dicts; times in seconds).

    Raises:
        KeyError: a target is missing from ``runs``.
        ValueError: a target has no round or no completed request (:func:`.stats.target_summary`).
    """
    failed = {n: sum(r.failed for r in rs) for n, rs in runs.items()}
    summary = {n: target_summary(rs) for n, rs in runs.items()}
    rat = ratios(summary["leasekit"], summary["stock"])
    verdicts = {m: metric_verdict(m, rat[m], {n: summary[n]["spread"][m] for n in TARGETS},
                                  higher_is_better=HIGHER_IS_BETTER[m])
                for m in METRICS}
    rounds_phase = merge_phases("rounds", round_phases)
    return {
        "summary": summary,
        "ratios": rat,
        "verdicts": {m: vars(v) for m, v in verdicts.items()},
        "goal_verdict": vars(goal_verdict([verdicts["rps"], verdicts["p99_s"]], failed)),
        "span_phases": [p.to_json() for p in [*round_phases, rounds_phase, *queue_phases]],
        "span_volume": span_volume_verdict([rounds_phase, *queue_phases]),
    }


def format_table(doc: dict[str, Any]) -> str:
    """The human report of a completed result document (as :func:`analyze` fills it, plus
    ``config``, ``lease_timing``, ``result_file``, the span volume's ``stock_pair_spans`` and
    ``unparsable_span_lines`` and optionally ``leasekit_metrics``): one string of lines, latencies
    shown in ms.

    Raises:
        KeyError: the document lacks one of those keys (an interrupted or failed run).
    """
    c, s, r = doc["config"], doc["summary"], doc["ratios"]
    lt = doc["lease_timing"]
    lines = [
        ("telemetry overhead: LeaseKitPushConnector vs stock NixlPushConnector (both sides, push mode)"
         if c.get("transfer_mode") == "push" else
         "telemetry overhead: LeaseKitConnector vs stock NixlConnector (both sides)") + ", real vLLM P/D pairs on CPU",
        (f"{c['rounds']} rounds x {c['requests']} requests per target, {c['concurrency']} concurrent clients, "
         f"prompt {c['prompt_tokens']} tokens, {c['max_tokens']} generated; L={lt['L_s']:g} s (H={lt['H_s']:g} s, "
         f"E={lt['E_s']:g} s); D max-num-seqs {c['decode_max_seqs']}; order A B B A (A=stock)"),
        "",
        f"{'target':<9} {'ok/req':>9} {'req/s':>7} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8}   round-to-round spread (req/s, p99)",
    ]
    for n in TARGETS:
        t = s[n]
        sp = t["spread"]
        fmt = lambda v: "n/a" if v is None else f"{v:.1%}"
        lines.append(f"{n:<9} {t['ok']:>4}/{t['requests']:<4} {t['rps']:7.2f} {t['tokens_per_s']:8.1f} "
                     f"{t['p50_s'] * 1000:8.1f} {t['p99_s'] * 1000:8.1f}   {fmt(sp['rps'])}, {fmt(sp['p99_s'])}")
    lines += ["", ("ratio leasekit/stock   pooled   per-round min..max   leasekit worse in   "
              "(throughput: <1 slower; latency: >1 slower)")]
    for m, label in (("rps", "throughput req/s"), ("tokens_per_s", "throughput tok/s"), ("p50_s", "p50 latency"),
                     ("p99_s", "p99 latency")):
        x = r[m]
        rng = "n/a" if x["min"] is None else f"{x['min']:.3f}..{x['max']:.3f}"
        lines.append(f"  {label:<19} {x['ratio']:7.3f}   {rng:<18}   {x['rounds_worse']}/{len(x['per_round'])} rounds")
    lines.append("")
    v = doc["verdicts"]
    for m, label in (("rps", "throughput"), ("p99_s", "p99 latency")):
        lines.append(f"goal {label}: {v[m]['status'].upper()}: {v[m]['reason']}")
    g = doc["goal_verdict"]
    lines.append(f"goal (<= {GOAL_TOLERANCE:.0%} throughput and p99 overhead): {g['status'].upper()}")
    lines += ["", "span volume (leasekit pair's span files):",
              f"  {'phase':<12} {'requests':>8} {'spans':>6} {'spans/req':>9} {'ext/lease':>9} {'max ext':>7}  spans by name"]
    for p in doc["span_phases"]:
        if p["name"].startswith("round "):
            continue
        mx = "-" if p["max_extensions_per_lease"] is None else p["max_extensions_per_lease"]
        lines.append(f"  {p['name']:<12} {p['requests']:>8} {p['spans']:>6} {p['spans_per_request']:>9.2f} "
                     f"{p['mean_extensions_per_lease']:>9.1f} {mx:>7}  {p['by_name']}")
    sv = doc["span_volume"]
    lines.append(f"  O(requests) span volume: {sv['status'].upper()}: {sv['reason']}")
    lines.append(f"  stock pair span files: {sv['stock_pair_spans']} spans; unparsable lines: {sv['unparsable_span_lines']}")
    for side, delta in (doc.get("leasekit_metrics", {}).get("delta") or {}).items():
        totals = {k.removeprefix("leasekit_kv_").removesuffix("_total"): v for k, v in delta.items() if k.endswith("_total")}
        if totals:
            lines.append(f"  leasekit {side} /metrics counters over the measurement (incl. warm-ups after switches): "
                         + ", ".join(f"{k} +{v:g}" for k, v in sorted(totals.items())))
    lines.append(f"\nresult: {doc['result_file']}")
    return "\n".join(lines)
