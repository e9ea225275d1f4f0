"""What D's read gate costs on the normal path (docs/fail-closed.md), against baselines measured
in the same run.

Goal: no more than one notification round trip per request, and no extra latency when the lease is
comfortably alive (the grant's pledge or P's heartbeat acknowledgements already prove it: the gate's fast
path, no wait).

Measured (all times seconds, ``time.perf_counter``/``monotonic`` of the process that records them):

1. baseline: the NIXL notification round trip (two UCX agents in this process, ping -> pong, the same
   ``nixl`` package vLLM uses), ``--pings`` times;
2. a stock P/D pair (vLLM's NixlConnector both sides), a LeaseKit pair without the protocol
   (``leasekit_fail_closed`` off: the baseline for the gate alone), a fail-closed LeaseKit pair without
   the grant pledge (``leasekit_pledge_s`` 0: the protocol before the pledge) and the default fail-closed
   LeaseKit pair, one after the other, each serving ``--requests`` routed requests one at a time: D's
   HTTP latency per request;
3. on both fail-closed pairs: D's ``kv_lease_read`` spans: how long each finished read was held for P's
   verdict (``leasekit.read_verdict_wait_s``), the share held not at all, and what proved it
   (``leasekit.read_proof``: the grant's pledge, P's acknowledgement of D's read probe, or the verdict);
   on P the seconds a completed lease's blocks stayed pinned for its pledge (``leasekit.pledge_hold_s``,
   the cost of the pledge: P memory, not latency);
4. on the LeaseKit pair: ``--queued`` requests that wait in D's queue (a held slot) for
   ``--queue-s`` seconds first, so D heartbeats them and P acknowledges: the share released by the
   fast path with no wait.

Prints the ratios: verdict wait p50 / notification round trip p50 (goal: at most one round trip plus
P's step), fail-closed / stock and fail-closed / LeaseKit-open D latency p50 (goal: about 1), and the
fast-path shares of immediate and queued reads (goal: 1.0), with and without the pledge.
Exit code 0 when the run completed, whatever the numbers.

    flock /tmp/leasekit-pair.lock .venv/bin/python benchmarks/fail_closed_cost.py [--requests N]

SIGINT/SIGTERM stop every server (the pairs are context managers) before exiting (130/143).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.spanfile import read_span_dir


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def notification_round_trip(pings: int) -> list[float]:
    """Round trips (s) of one NIXL notification each way between two UCX agents in this process."""
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("bench-ping", config), nixl_agent("bench-pong", config)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    times = []
    for i in range(pings + 5):
        start = time.perf_counter()
        a.send_notif("bench-pong", f"ping{i}".encode())
        while not b.get_new_notifs():
            pass
        b.send_notif("bench-ping", f"pong{i}".encode())
        while not a.get_new_notifs():
            pass
        if i >= 5:  # the first ones set up UCX endpoints
            times.append(time.perf_counter() - start)
    return times


def routed_latencies(pair: PDPair, requests: int) -> list[float]:
    """D's HTTP latency (s) of ``requests`` routed requests, one at a time."""
    out = []
    for _ in range(requests):
        result = pair.router.generate(pair.prompt(48), 4)
        if result.decode is not None and result.decode.ok:
            out.append(result.decode.latency_s)
    return out


def queued_requests(pair: PDPair, requests: int, queue_s: float) -> list[str]:
    """Route ``requests`` requests behind a held D slot, let them wait ``queue_s`` s, release; P ids."""
    stop = threading.Event()
    threading.Thread(target=pair.router.hold_decode_slot, args=(pair.prompt(16), stop), daemon=True).start()
    time.sleep(2.0)
    ids, threads = [], []
    for _ in range(requests):
        prompt = pair.prompt(48)
        prefill = pair.router.prefill(prompt)
        ids.append(prefill.request_id)
        thread = threading.Thread(target=pair.router.decode, args=(prompt, prefill.kv_transfer_params, 4), daemon=True)
        thread.start()
        threads.append(thread)
    time.sleep(queue_s)
    stop.set()
    for thread in threads:
        thread.join(120)
    return ids


def read_waits(pair: PDPair) -> dict[str, tuple[str, float]]:
    """P request id -> (read outcome, verdict wait in s) from D's ``kv_lease_read`` spans."""
    return {rid: (outcome, wait) for rid, (outcome, wait, _proof) in read_spans(pair).items()}


def read_spans(pair: PDPair) -> dict[str, tuple[str, float, str | None]]:
    """P request id -> (read outcome, verdict wait in s, proof) from D's ``kv_lease_read`` spans."""
    out = {}
    for span in read_span_dir(pair.span_dir).spans:
        if span.name == sc.READ_SPAN_NAME:
            out[span.attributes.get(sc.REQUEST_ID)] = (span.attributes.get(sc.READ_OUTCOME),
                                                       float(span.attributes.get(sc.READ_VERDICT_WAIT_S, 0.0)),
                                                       span.attributes.get(sc.READ_PROOF))
    return out


def pledge_holds(pair: PDPair) -> list[float]:
    """Seconds each completed lease's blocks stayed pinned for its pledge, from P's lease spans."""
    return [float(span.attributes[sc.PLEDGE_HOLD_S]) for span in read_span_dir(pair.span_dir).spans
            if span.name == sc.LEASE_SPAN_NAME and sc.PLEDGE_HOLD_S in span.attributes]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="routed requests per pair (default 40)")
    parser.add_argument("--queued", type=int, default=6, help="queued requests on the LeaseKit pair (default 6)")
    parser.add_argument("--queue-s", type=float, default=6.0,
                        help="seconds they wait in D's queue (default 6: longer than H = L // 6 at L = 30, so D heartbeats them)")
    parser.add_argument("--pings", type=int, default=500, help="notification round trips (default 500)")
    parser.add_argument("--lease-duration", type=float, default=30.0, help="L in seconds (default 30)")
    parser.add_argument("--run-dir", type=Path, default=None, help="where the pairs write (default a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    for name, value in (("--requests", args.requests), ("--queued", args.queued), ("--pings", args.pings)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="leasekit-fail-closed-"))
    result: dict = {"run_dir": str(run_dir)}
    try:
        rtt = notification_round_trip(args.pings)
        result["notification_rtt_p50_s"] = _pct(rtt, 0.5)
        for target, connector, fail_closed, pledge in (("stock", "stock", False, None),
                                                        ("leasekit_open", "leasekit", False, None),
                                                        ("nopledge", "leasekit", True, 0.0),
                                                        ("leasekit", "leasekit", True, None)):
            spec = PairSpec.pinned(lease_duration_s=args.lease_duration, prefill_connector=connector,
                                   decode_connector=connector, fail_closed=fail_closed, prefill_pledge_s=pledge)
            with PDPair(spec, run_dir / target) as pair:
                result[f"{target}_latency_p50_s"] = _pct(routed_latencies(pair, args.requests), 0.5)
                if fail_closed:
                    spans = read_spans(pair)
                    immediate = [w for outcome, w, _ in spans.values() if outcome == "verified"]
                    result[f"{target}_immediate_fast_path_share"] = (
                        sum(1 for w in immediate if w == 0.0) / len(immediate) if immediate else None)
                    result[f"{target}_verdict_wait_p50_s"] = _pct(immediate, 0.5)
                    result[f"{target}_verdict_wait_p99_s"] = _pct(immediate, 0.99)
                    result[f"{target}_proofs"] = {proof: sum(1 for o, _, p in spans.values() if o == "verified" and p == proof)
                                                  for proof in ("pledge", "ack", "verdict")}
                    result[f"{target}_discarded_reads"] = sum(1 for outcome, _, _ in spans.values() if outcome != "verified")
                    time.sleep(2.0)  # the last pledges end
                    result[f"{target}_pledge_hold_p50_s"] = _pct(pledge_holds(pair), 0.5)
                if target == "leasekit":
                    queued = queued_requests(pair, args.queued, args.queue_s)
                    time.sleep(1.0)
                    waits = read_waits(pair)
                    fast = [rid for rid in queued if waits.get(rid, ("", 1.0)) == ("verified", 0.0)]
                    result["queued_fast_path_share"] = len(fast) / len(queued)
    except KeyboardInterrupt:
        result["interrupted"] = True
    rtt50, wait50 = result.get("notification_rtt_p50_s"), result.get("leasekit_verdict_wait_p50_s")
    wait50_np = result.get("nopledge_verdict_wait_p50_s")
    stock50, lk50 = result.get("stock_latency_p50_s"), result.get("leasekit_latency_p50_s")
    open50, np50 = result.get("leasekit_open_latency_p50_s"), result.get("nopledge_latency_p50_s")
    result["fail_closed_over_open_latency"] = lk50 / open50 if lk50 is not None and open50 else None
    result["nopledge_over_open_latency"] = np50 / open50 if np50 is not None and open50 else None
    result["verdict_wait_over_rtt"] = wait50 / rtt50 if wait50 is not None and rtt50 else None
    result["nopledge_verdict_wait_over_rtt"] = wait50_np / rtt50 if wait50_np is not None and rtt50 else None
    result["leasekit_over_stock_latency"] = lk50 / stock50 if lk50 is not None and stock50 else None
    rows = [
        ("NIXL notification round trip p50 (baseline)", rtt50, "s"),
        ("verdict wait p50 / p99 (immediate reads)",
         f"{wait50 if wait50 is None else round(wait50, 5)} / {result.get('leasekit_verdict_wait_p99_s')}", ""),
        ("verdict wait p50 / notification round trip p50", result["verdict_wait_over_rtt"], "x"),
        ("  same without the pledge", result["nopledge_verdict_wait_over_rtt"], "x"),
        ("immediate reads released without waiting", result.get("leasekit_immediate_fast_path_share"), "share"),
        ("  same without the pledge (probe ack only)", result.get("nopledge_immediate_fast_path_share"), "share"),
        ("immediate reads verified by pledge / ack / verdict",
         " / ".join(str(result.get("leasekit_proofs", {}).get(p)) for p in ("pledge", "ack", "verdict")), ""),
        ("D latency p50: stock / open / no pledge / fail-closed", f"{stock50} / {open50} / {np50} / {lk50}", "s"),
        ("D latency p50 ratio fail-closed / stock", result["leasekit_over_stock_latency"], "x"),
        ("D latency p50 ratio fail-closed / LeaseKit open (the gate)", result["fail_closed_over_open_latency"], "x"),
        ("  same without the pledge", result["nopledge_over_open_latency"], "x"),
        ("P pledge hold p50 (blocks pinned after the completion)", result.get("leasekit_pledge_hold_p50_s"), "s"),
        ("queued reads released without waiting (fast path)", result.get("queued_fast_path_share"), "share"),
        ("reads discarded (should be 0 on the normal path)",
         f"{result.get('leasekit_discarded_reads')} / {result.get('nopledge_discarded_reads')} (no pledge)", ""),
    ]
    for label, value, unit in rows:
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        print(f"{label:56} {shown} {unit}".rstrip())
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if result.get("interrupted"):
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
