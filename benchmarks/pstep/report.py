"""Goals, verdicts and the printed table of ``benchmarks/step_cost.py`` (pure: no vLLM import).

A result (``dict``, what ``-o json`` prints) holds ``p`` (one entry per N: per-side summaries of
:class:`benchmarks.pstep.measure.Samples`), ``memory`` (per side) and ``d`` (one entry per N). Sides:
``stock`` (vLLM's ``NixlPullConnectorWorker``), ``leasekit`` (``LeaseKitPullWorker``, span export on),
``leasekit_export_off`` (same, ``OTEL_SDK_DISABLED=true``). ``blocked`` (optional) holds ``n``, ``steps``,
``otlp_timeout_s`` and per side (``leasekit``, ``leasekit_frozen_span_file``, ``leasekit_otlp_black_hole``)
the summary plus ``dropped`` and ``failed`` (spans).
"""

from __future__ import annotations

from typing import Any

STOCK, LEASEKIT, LEASEKIT_OFF = "stock", "leasekit", "leasekit_export_off"
LEASEKIT_BLOCKED = "leasekit_frozen_span_file"
LEASEKIT_OTLP_BLOCKED = "leasekit_otlp_black_hole"
BLOCKED_GOAL = 1.10  # a blocked span sink (frozen file, OTLP endpoint that never answers) leaves P's step within 10 % of normal
BLOCKED_SIDES = {LEASEKIT_BLOCKED: "a frozen span file", LEASEKIT_OTLP_BLOCKED: "an OTLP endpoint that never answers"}
SIDES = (STOCK, LEASEKIT, LEASEKIT_OFF)
NOTIF_GOAL_US = 100.0
MEMORY_GOAL_BYTES = 1024.0
MEMORY_GOAL_N = 10_000
MEMORY_GOAL_HEARTBEATS = 64
STEP_RATIO_GOALS = {1_000: 1.5, 10_000: 1.0, 100_000: 1.0}  # LeaseKit/stock, empty P step, export on
SCALING_GOAL = 2.0  # LeaseKit step at 100k / at 1k


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return None if a is None or not b else a / b


def _by_n(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {entry["n"]: entry for entry in entries}


def _valid(entry: dict[str, Any], *sides: str) -> bool:
    return all(entry[side].get("unexpected_releases", 0) == 0 for side in sides if side in entry)


def verdict(ok: bool | None, valid: bool = True) -> str:
    """``PASS``/``FAIL``; ``n/a`` when not measured; ``INVALID`` when a lease ended unexpectedly."""
    if ok is None:
        return "n/a"
    if not valid:
        return "INVALID"
    return "PASS" if ok else "FAIL"


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per goal: ``goal`` (text), ``value``, ``limit``, ``verdict``."""
    out: list[dict[str, Any]] = []
    p = _by_n(result.get("p", []))
    for n, limit in STEP_RATIO_GOALS.items():
        entry = p.get(n)
        value = ratio(entry[LEASEKIT]["empty_us"], entry[STOCK]["empty_us"]) if entry else None
        out.append({"goal": f"P step, nothing new, N={n}: LeaseKit/stock <= {limit}x (export on)",
                    "value": value, "limit": limit,
                    "verdict": verdict(None if value is None else value <= limit, bool(entry) and _valid(entry, STOCK, LEASEKIT))})
    small, large = p.get(1_000), p.get(100_000)
    value = ratio(large[LEASEKIT]["empty_us"], small[LEASEKIT]["empty_us"]) if small and large else None
    out.append({"goal": f"P step, LeaseKit: cost at N=100k / at N=1k <= {SCALING_GOAL}x", "value": value,
                "limit": SCALING_GOAL, "verdict": verdict(None if value is None else value <= SCALING_GOAL,
                                                          bool(small and large) and _valid(small, LEASEKIT) and _valid(large, LEASEKIT))})
    for n, entry in sorted(p.items()):
        value = entry[LEASEKIT].get("notif_minus_empty_us")
        out.append({"goal": f"P, 1 heartbeat (16 leases) + 1 completion, N={n}: LeaseKit <= {NOTIF_GOAL_US:.0f} µs",
                    "value": value, "limit": NOTIF_GOAL_US,
                    "verdict": verdict(None if value is None else value <= NOTIF_GOAL_US, _valid(entry, LEASEKIT))})
    memory = result.get("memory", {}).get(LEASEKIT)
    value = memory["bytes_per_lease_after_heartbeats"] if memory else None
    measured_as_goal = bool(memory) and memory["n"] == MEMORY_GOAL_N and memory["heartbeats_each"] == MEMORY_GOAL_HEARTBEATS
    out.append({"goal": f"P memory, N={MEMORY_GOAL_N}, {MEMORY_GOAL_HEARTBEATS} heartbeats each: LeaseKit <= "
                        f"{MEMORY_GOAL_BYTES:.0f} B per live lease",
                "value": value, "limit": MEMORY_GOAL_BYTES,
                "verdict": verdict(None if not measured_as_goal else value <= MEMORY_GOAL_BYTES,
                                   bool(memory) and memory.get("unexpected_releases", 0) == 0)})
    blocked = result.get("blocked")
    for side, what in BLOCKED_SIDES.items():
        stuck = blocked.get(side) if blocked else None
        if not stuck:
            continue  # a result from before this side existed
        value = ratio(stuck.get("notif_us"), blocked[LEASEKIT].get("notif_us"))
        out.append({"goal": f"P step with {what}, N={blocked['n']}: <= {BLOCKED_GOAL}x normal, "
                            "and the spans it could not export counted",
                    "value": value, "limit": BLOCKED_GOAL,
                    "verdict": verdict(None if value is None else value <= BLOCKED_GOAL and stuck["dropped"] > 0,
                                       _valid(blocked, LEASEKIT, side))})
    return out


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = lambda row: "  ".join(str(cell).rjust(w) for cell, w in zip(row, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def render(result: dict[str, Any]) -> str:
    """The tables printed at the end of a run (medians, µs per engine step; ratios against stock)."""
    parts = []
    g = {item["goal"]: item for item in goals(result)}
    rows = []
    for entry in result.get("p", []):
        n, s, lk, off = entry["n"], entry[STOCK], entry[LEASEKIT], entry.get(LEASEKIT_OFF, {})
        limit = STEP_RATIO_GOALS.get(n)
        item = next((x for k, x in g.items() if k.startswith(f"P step, nothing new, N={n}:")), None)
        rows.append([n, _f(s["empty_us"]), _f(lk["empty_us"]), _f(ratio(lk["empty_us"], s["empty_us"]), ".2f"),
                     _f(off.get("empty_us")), _f(ratio(off.get("empty_us"), s["empty_us"]), ".2f"),
                     f"<= {limit}x" if limit else "-", item["verdict"] if item else "-"])
    parts.append("P engine step, nothing new (N live leases, none expiring)\n" + _table(
        ["N", "stock µs", "LeaseKit µs", "ratio", "LK export off µs", "ratio", "goal", "verdict"], rows))
    rows = []
    for entry in result.get("p", []):
        n, s, lk, off = entry["n"], entry[STOCK], entry[LEASEKIT], entry.get(LEASEKIT_OFF, {})
        item = next((x for k, x in g.items() if k.startswith("P, 1 heartbeat") and f"N={n}:" in k), None)
        rows.append([n, _f(s.get("notif_minus_empty_us")), _f(lk.get("notif_minus_empty_us")),
                     _f(ratio(lk.get("notif_minus_empty_us"), s.get("notif_minus_empty_us")), ".2f"),
                     _f(off.get("notif_minus_empty_us")), _f(s.get("notif_us")), _f(lk.get("notif_us")),
                     f"<= {NOTIF_GOAL_US:.0f} µs", item["verdict"] if item else "-"])
    parts.append("P: 1 heartbeat naming 16 leases + 1 completion (that step minus the empty step before it; "
                 "whole step)\n" + _table(["N", "stock µs", "LeaseKit µs", "ratio", "LK export off µs",
                                            "stock step µs", "LK step µs", "goal", "verdict"], rows))
    scaling = next((x for k, x in g.items() if k.startswith("P step, LeaseKit: cost")), None)
    if scaling:
        parts.append(f"LeaseKit P step at N=100k / N=1k: {_f(scaling['value'], '.2f')}x "
                     f"(goal <= {SCALING_GOAL}x): {scaling['verdict']}")
    memory = result.get("memory", {})
    if memory:
        rows = []
        item = next((x for k, x in g.items() if k.startswith("P memory")), None)
        for side in SIDES:
            m = memory.get(side)
            if m:
                rows.append([side, m["n"], _f(m["bytes_per_lease_granted"], ".0f"),
                             _f(m["bytes_per_lease_after_heartbeats"], ".0f"), m["heartbeats_each"],
                             _f(ratio(m["bytes_per_lease_after_heartbeats"],
                                      memory.get(STOCK, {}).get("bytes_per_lease_after_heartbeats")), ".1f"),
                             f"<= {MEMORY_GOAL_BYTES:.0f} B" if side == LEASEKIT else "-",
                             item["verdict"] if item and side == LEASEKIT else "-"])
        parts.append("P memory per live lease (tracemalloc, bytes)\n" + _table(
            ["worker", "N", "after grants", "after heartbeats", "heartbeats each", "x stock", "goal", "verdict"], rows))
    rows = []
    for entry in result.get("d", []):
        n, s, lk, off = entry["n"], entry[STOCK], entry[LEASEKIT], entry.get(LEASEKIT_OFF, {})
        rows.append([n, _f(s.get("empty_us")), _f(lk.get("empty_us")), _f(ratio(lk.get("empty_us"), s.get("empty_us")), ".2f"),
                     _f(off.get("empty_us")), _f(s.get("heartbeat_us")), _f(lk.get("heartbeat_us")),
                     _f(ratio(lk.get("heartbeat_us"), s.get("heartbeat_us")), ".2f"), _f(off.get("heartbeat_us"))])
    if rows:
        parts.append("D engine step, N tracked requests waiting (no goal: informational)\n" + _table(
            ["N", "stock µs", "LeaseKit µs", "ratio", "LK export off µs", "stock HB step µs", "LK HB step µs",
             "ratio", "LK export off HB µs"], rows))
    blocked = result.get("blocked")
    if blocked:
        rows = []
        for side in (LEASEKIT, *BLOCKED_SIDES):
            e = blocked.get(side)
            if e:
                rows.append([side, blocked["n"], _f(e.get("notif_us")), _f(e.get("notif_p99_us")),
                             _f(ratio(e.get("notif_us"), blocked[LEASEKIT].get("notif_us")), ".2f"),
                             e["dropped"], e["failed"]])
        timeout = blocked.get("otlp_timeout_s")
        parts.append(f"P with a blocked span sink: a frozen span file (a FIFO nobody reads), an OTLP endpoint that "
                     f"never answers{f' (timeout {timeout:g} s)' if timeout else ''}; {blocked['steps']} notification "
                     "steps each (heartbeat + completion: one span ended per step)\n" + _table(
                         ["worker", "N", "step µs", "p99 µs", "x normal", "spans dropped", "export failures"], rows))
    bad = [f"{kind} N={e['n']} {side}: {e[side]['unexpected_releases']}" for kind in ("p", "d")
           for e in result.get(kind, []) for side in SIDES if e.get(side, {}).get("unexpected_releases")]
    parts.append("Unexpected lease ends while timed: " + (", ".join(bad) if bad else "none"))
    parts.append("Goals\n" + "\n".join(f"  {item['verdict']:7s} {item['goal']}: {_f(item['value'], '.2f')}"
                                       for item in goals(result)))
    return "\n\n".join(parts)
