"""Telemetry overhead: LeaseKitConnector against stock NixlConnector on real vLLM P/D pairs, one run.

A pair with LeaseKitConnector on both sides and a pair with vLLM's stock NixlConnector on both
sides serve the same routed workload in one run.

Both pairs are started once (P and D each pinned to its own core; the two pairs share the two
cores) and warmed up. The pair not being measured is drained (no request in flight, every lease
released, every lease span written) and parked with SIGSTOP, so that its busy-polling threads take
no CPU; a parked pair holds no lease that could expire. Round k measures both targets back to back,
the order alternating ``stock leasekit | leasekit stock | stock leasekit ...`` (A B B A: a linear
drift adds the same to both sides of two consecutive rounds). Each measurement routes N requests
(seeded random prompts of a fixed length, the same prompts for both targets in one round, fresh
ones every round so no prefix-cache hit helps either side; fixed ``max_tokens``, ``ignore_eos``)
P -> D from C concurrent clients after an unmeasured warm-up of C requests whenever the target
changes, and records throughput (requests/s, generated tokens/s over the round's wall time) and
each request's end-to-end latency (prefill on P + decode on D, as the router sees it).

Reported: per target the pooled throughput and p50/p99 latency; the ratios leasekit/stock with the
min..max of the per-round ratios; the goal (<= 2 % throughput and p99 latency overhead) as ``met``,
``not met`` or ``inconclusive``. It is inconclusive with fewer than 3 rounds, or when the round-to-
round spread ((max - min) / median of the per-round values) of the stock baseline, or of the
leasekit pair, exceeds the 2 % being resolved, unless even the best round misses the goal by more
than that spread (then ``not met``).

Span volume: the leasekit pair's span files (``<run dir>/leasekit-pair/spans``) are counted after
every measured round and after queue phases in which requests wait in D's queue for several
heartbeat intervals (every D running slot held by a long local generation, as
``leasekit.chaos.workload.QueuedDecodeLoad`` does with one slot), so P extends each lease once per
heartbeat. Spans per request must stay constant while extensions per lease grow (span volume
O(requests), not O(requests x heartbeats)): the slope d(spans/request) / d(extensions/lease)
between the phases with the fewest and most extensions is reported and must be about 0.

Run (take the pair lock: other engineers run pairs on this host too)::

    flock /tmp/leasekit-pair.lock .venv/bin/python benchmarks/telemetry_overhead.py \\
        [--requests N] [--rounds R] [--concurrency C] [--lease-duration L] [--run-dir DIR] [-o table|json]
        [--transfer-mode pull|push]

``--transfer-mode push`` runs both pairs in push mode (P WRITEs into D): LeaseKitPushConnector against vLLM's
NixlPushConnector, same workload and verdicts.

Writes ``<run dir>/telemetry_overhead.json``. Exit code 0 when the run completed (whatever the
verdict), 1 when it could not run (a pair did not start, requests failed to route), 130/143 on
SIGINT/SIGTERM. Every server is stopped on every exit path.

This file is the command and its options; the parts live in ``benchmarks/overhead/`` (statistics,
verdicts, span volume, report, pairs, workload, runner: see that package's docstring).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: leasekit, benchmarks.overhead
from benchmarks.overhead.runner import execute


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's options from ``argv`` (None: ``sys.argv[1:]``); ``queue_heartbeats`` becomes a
    list of floats, ``run_dir`` defaults to ``runs/<time>-telemetry-overhead``. Times in seconds.

    Raises:
        SystemExit: ``--help`` (code 0) or an invalid option (code 2, argparse's message on stderr).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64, help="requests per target per round (default 64)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds; each measures both targets (default 8)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--lease-duration", type=float, default=6.0,
                    help="kv_lease_duration L in seconds (default 6: H = 1 s, a heartbeat every second; "
                         "the chaos catalog's L)")
    ap.add_argument("--run-dir", help="logs, spans and telemetry_overhead.json (default runs/<time>-telemetry-overhead)")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens D generates per request (default 16)")
    ap.add_argument("--decode-max-seqs", type=int, default=4, help="D's --max-num-seqs (default 4)")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests per pair after start (default 8)")
    ap.add_argument("--queue-heartbeats", default="1,6",
                    help="queue phases: how long requests wait in D's queue, in heartbeat intervals H (default 1,6)")
    ap.add_argument("--queue-requests", type=int, default=10, help="requests per queue phase (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transfer-mode", choices=["pull", "push"], default="pull",
                    help="pull: LeaseKitConnector vs NixlConnector; push: LeaseKitPushConnector vs NixlPushConnector")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        args.queue_heartbeats = [float(x) for x in str(args.queue_heartbeats).split(",") if x.strip()]
    except ValueError:
        ap.error("--queue-heartbeats: comma-separated numbers, e.g. 1,6")
    for name in ("requests", "rounds", "concurrency", "decode_max_seqs", "queue_requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lease_duration < 6:
        print(f"warning: --lease-duration {args.lease_duration:g} < 6 gives H = 0 (a heartbeat every step)",
              file=sys.stderr)
    if not args.run_dir:
        args.run_dir = str(Path("runs") / f"{dt.datetime.now():%Y%m%d-%H%M%S}-telemetry-overhead")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the benchmark; returns the exit code (see the module docstring)."""
    return execute(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
