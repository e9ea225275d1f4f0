"""One run of the telemetry-overhead benchmark: start both pairs, warm them up, measure the rounds in
A B B A order, run the queue phases on the leasekit pair, stop every server, then analyze and write
``<run dir>/telemetry_overhead.json`` and print the report (:func:`execute`)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
from pathlib import Path
from typing import Any

from .pairs import (
    HarnessError,
    Target,
    log,
    make_pairs,
    other_vllm_servers,
    park_pair,
    scrape_leasekit_metrics,
    start_pairs,
    stop_pairs,
    switch_pair,
    unpark_pair,
)
from .report import analyze, format_table
from .spans import SpanPhase
from .stats import TARGETS, RunStats, counter_deltas
from .verdicts import GOAL_TOLERANCE
from .workload import measure, queued_phase, round_order, seeded_prompts, warm_up


class _Session:
    """The started pairs of one run and where the run is: which pair is unparked (``active``), the
    leasekit metrics scraped before the measurement, the span phases of the leasekit rounds; each
    measured round is appended to ``runs`` (the result document's list) as it finishes."""

    def __init__(self, args, pairs: dict[str, Any], targets: dict[str, Target], vocab: int, runs: list):
        self.args, self.pairs, self.targets, self.vocab, self.runs = args, pairs, targets, vocab, runs
        self.active: str | None = None
        self.metrics_before: dict[str, dict[str, float]] | None = None  # once leasekit is unparked and warm
        self.round_phases: list[SpanPhase] = []

    def warm_up_both(self) -> None:
        """Warm both pairs up after the start (leasekit is unparked then); ends with both parked."""
        a = self.args
        for n in ("leasekit", "stock"):
            log(f"warming up {n}: {a.warmup} requests")
            unpark_pair(self.pairs[n])
            warm_up(self.targets[n], seeded_prompts(a.seed, -1 - TARGETS.index(n), a.warmup, a.prompt_tokens,
                                                    self.vocab), a.concurrency, a.max_tokens)
            park_pair(self.pairs[n])

    def measure_round(self, round_index: int, name: str) -> RunStats:
        """Measure ``name`` in round ``round_index``, switching pairs (and warming up) first if needed.

        Raises:
            HarnessError: the pair did not drain.
        """
        a, t = self.args, self.targets[name]
        if self.active != name:
            self.active = switch_pair(self.pairs, self.active, name)
            # unmeasured: wake caches and the NIXL progress threads after the SIGCONT
            warm_up(t, seeded_prompts(a.seed, -10 - round_index, a.concurrency, a.prompt_tokens, self.vocab),
                    a.concurrency, a.max_tokens, require_one_ok=False)
            if name == "leasekit" and self.metrics_before is None:
                self.metrics_before = scrape_leasekit_metrics(t)
        before = t.spans.snapshot()
        prompts = seeded_prompts(a.seed, round_index, a.requests, a.prompt_tokens, self.vocab)
        stats, ids = measure(t, round_index, prompts, a.concurrency, a.max_tokens)
        t.drain(ids)
        t.runs.append(stats)
        self.runs.append(stats.to_json())
        line = (f"round {round_index} {name:<8} {stats.ok}/{stats.requests} ok  {stats.rps:6.2f} req/s "
                f"{stats.tokens_per_s:7.1f} tok/s  p50 {stats.latency(50) * 1000 if stats.latencies_s else math.nan:7.1f} ms "
                f"p99 {stats.latency(99) * 1000 if stats.latencies_s else math.nan:7.1f} ms")
        if name == "leasekit":
            self.round_phases.append(t.spans.snapshot().phase_since(before, f"round {round_index}", len(prompts), ids))
            line += f"  {self.round_phases[-1].spans_per_request:.2f} spans/request"
        log(line)
        return stats

    def queue_phases(self, heartbeat_s: float) -> list[SpanPhase]:
        """Run a queue phase per ``--queue-heartbeats`` entry k on the leasekit pair (requests wait
        k * ``heartbeat_s`` seconds in D's queue); returns their span phases."""
        a, lk = self.args, self.targets["leasekit"]
        if self.active != "leasekit":
            self.active = switch_pair(self.pairs, self.active, "leasekit")
        if self.metrics_before is None:
            self.metrics_before = scrape_leasekit_metrics(lk)
        phases = []
        for k in a.queue_heartbeats:
            hold = k * heartbeat_s
            log(f"queue phase: {a.queue_requests} requests wait in D's queue {hold:g} s (~{k:g} heartbeat intervals)")
            before = lk.spans.snapshot()
            ids = queued_phase(lk, hold, a.queue_requests, a.prompt_tokens, self.vocab, a.seed,
                               slots=a.decode_max_seqs, max_tokens=a.max_tokens)
            lk.drain(ids)
            phase = lk.spans.snapshot().phase_since(before, f"queued {k:g}H", len(ids), ids, hold_s=hold)
            phases.append(phase)
            log(f"  {phase.spans_per_request:.2f} spans/request, {phase.mean_extensions:.1f} extensions/lease "
                f"(max {max(phase.extensions) if phase.extensions else '-'}), outcomes {phase.outcomes}")
        return phases


def run(args, doc: dict[str, Any]) -> None:
    """Start both pairs, run the rounds and queue phases; fills the result document ``doc`` as it
    goes (so a failed or interrupted run still leaves what it measured). ``args`` are the command's
    options (times in seconds). Every server is stopped on every exit path.

    Raises:
        HarnessError: the run could not measure (a pair did not drain, requests did not route, no
            request completed on a target).
        Exception: whatever starting a pair raises.
    """
    from leasekit.cluster.model import VOCAB_SIZE
    from leasekit.lease.config import LeaseTiming

    timing = LeaseTiming.from_lease_duration(args.lease_duration)
    run_dir = Path(args.run_dir).resolve()
    doc.update({
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "lease_timing": {"L_s": timing.lease_duration_s, "H_s": timing.heartbeat_interval_s, "E_s": timing.extension_s},
        "goal": f"<= {GOAL_TOLERANCE:.0%} throughput and p99 latency overhead (leasekit vs stock)",
        "host": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "other_vllm_servers_at_start": other_vllm_servers(),
    })
    if doc["other_vllm_servers_at_start"]:
        log(f"warning: {len(doc['other_vllm_servers_at_start'])} vLLM server process(es) already running "
            "(not ours): they compete for the same cores; run under flock /tmp/leasekit-pair.lock")
    pairs = make_pairs(args, run_dir)
    targets = {n: Target(n, p) for n, p in pairs.items()}
    doc["runs"] = []  # filled as rounds finish
    session = _Session(args, pairs, targets, VOCAB_SIZE, doc["runs"])
    try:
        start_pairs(pairs, targets)
        doc["startup_s"] = {n: p.startup_s for n, p in pairs.items()}
        session.warm_up_both()
        for round_index, name in round_order(args.rounds):
            session.measure_round(round_index, name)
        # Queue phases on the leasekit pair: requests wait in D's queue for several heartbeats.
        queue_phases = session.queue_phases(timing.heartbeat_interval_s or 1.0)
        metrics_after = scrape_leasekit_metrics(targets["leasekit"])
        doc["leasekit_metrics"] = {"before": session.metrics_before, "after": metrics_after,
                                   "delta": counter_deltas(session.metrics_before, metrics_after)}
        stock_spans = targets["stock"].spans.snapshot().spans
        bad_lines = targets["leasekit"].spans.snapshot().bad_lines
    finally:
        stop_pairs(pairs)
    doc["host"]["loadavg_end"] = os.getloadavg()
    doc["drain_s"] = {n: t.drain_s for n, t in targets.items()}
    if any(t.runs and sum(r.ok for r in t.runs) == 0 for t in targets.values()):
        raise HarnessError(f"no request completed on a target; see {run_dir}/*-pair/logs")
    doc.update(analyze({n: t.runs for n, t in targets.items()}, session.round_phases, queue_phases))
    doc["span_volume"]["stock_pair_spans"] = stock_spans
    doc["span_volume"]["unparsable_span_lines"] = bad_lines


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every ``finally`` (pair teardown) runs."""


def execute(args) -> int:
    """The whole command after option parsing: :func:`run`, then write ``<run dir>/
    telemetry_overhead.json`` (always, a partial one on failure) and print the report (``-o
    table``) or the document (``-o json``) on stdout when the run completed.

    Returns:
        the exit code: 0 completed (whatever the verdict), 1 the benchmark could not run, 130 on
        SIGINT, 143 on SIGTERM. Harness failures are reported, not raised.
    """

    def on_term(signum, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, on_term)
    run_dir = Path(args.run_dir).resolve()
    path = run_dir / "telemetry_overhead.json"
    doc: dict[str, Any] = {"benchmark": "telemetry_overhead", "status": "running",
                           "started": dt.datetime.now().isoformat(timespec="seconds"),
                           "run_dir": str(run_dir), "result_file": str(path)}
    code = 0
    try:
        run(args, doc)
        doc["status"] = "completed"
    except KeyboardInterrupt:
        doc["status"], code = "interrupted", 130
        log("interrupted (SIGINT); every server was stopped")
    except _Terminated:
        doc["status"], code = "interrupted", 143
        log("terminated (SIGTERM); every server was stopped")
    except Exception as exc:  # noqa: BLE001 - a harness failure: say what, exit 1
        doc["status"], doc["error"], code = "error", f"{type(exc).__name__}: {exc}", 1
        log(f"benchmark could not run: {doc['error']}")
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if code == 0:
        print(json.dumps(doc, indent=2, default=str) if args.output == "json" else format_table(doc))
    else:
        log(f"partial result: {path}")
    return code
