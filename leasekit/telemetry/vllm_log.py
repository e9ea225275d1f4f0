"""Lease evidence from stock vLLM's own log lines (the stock-NixlConnector chaos target).

Stock vLLM emits no lease spans, but P's connector logs every lease transition. Launch the servers
with the logging config of :func:`leasekit.telemetry.vllm_logconfig.write_logging_config` (env
``VLLM_LOGGING_CONFIG_PATH``) and :func:`parse_stock_lease_log` rebuilds the same
:class:`~leasekit.telemetry.lease_timeline.LeaseTimeline` objects the span path produces, so the chaos
checks run unchanged on either target. The lines read, and how one is recognised, are in
:mod:`leasekit.telemetry.vllm_loglines`.

Release rule (stock vLLM logs no release line in the worker): a lease ends ``expired`` at the
worker's expiry line; otherwise ``released`` at the scheduler's "Finished sending" line (P freed the
blocks without reaping them, i.e. every consumer's read completion arrived). Without that line the
lease is still open, unless the caller names the request in ``served`` (a log written without the
scheduler logger at DEBUG): then it is ``released`` with ``end_s`` = its last logged instant (a
lower bound) and a ``release_inferred`` event. Open leases are returned apart (``open_leases``,
outcome :data:`OUTCOME_OPEN`), never to the checks, which treat a request with no ended lease as
"blocks still pinned".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_timeline import LeaseTimeline
from leasekit.telemetry.vllm_loglines import LogRecord, is_evidence, parse_line, split_lines, tp_rank_of

OUTCOME_OPEN = "open"
"""Outcome of a lease with no end in the log (``StockLogResult.open_leases``); ``end_s`` is then the
last instant the log covers, not an end."""

EVENT_LATE_READ = "late_read"
"""Timeline event: a read completion for this request arrived after P had reaped it."""

EVENT_RELEASE_INFERRED = "release_inferred"
"""Timeline event: released by the ``served`` rule, not by a logged line (``end_s`` is a lower bound)."""

LOG_STAMP_LATENCY_S = 0.05
"""Allowance for how long after vLLM reads its clock for a heartbeat the log line is stamped
(seconds). The record's ``t=`` is ``time.time()`` at the logging call, after ``_handle_heartbeat``
computed the new deadline; under load the gap grows (measured here: up to 10 ms at load average
~35 on 2 cores, which made correct reaps look 4-10 ms premature). A reclaim earlier than
``last heartbeat + E`` by less than this is within the evidence's uncertainty, not a FAIL."""


@dataclass
class StockLogResult:
    """What :func:`parse_stock_lease_log` found. Times are epoch seconds (P's wall clock).

    Attributes:
        leases: every ended lease, one per (request, P worker process): ``released`` or ``expired``.
            The input for ``leasekit.chaos.checks``.
        open_leases: leases with no end in the log, outcome :data:`OUTCOME_OPEN` and ``end_s`` = the
            last instant the log covers. For reports and plots, not for the checks.
        late_reads: ``(request_id, epoch_s)`` per "Potentially invalid KV blocks" line: a read
            completion for a lease P no longer held (D may have read freed blocks).
        bad_lines: lines carrying lease evidence that could not be parsed (skipped).
        other_lines: lines not in the log format (:data:`leasekit.telemetry.vllm_logconfig.LOG_FORMAT`:
            warnings, NIXL's own log, uvicorn; skipped).
        records: lines in the log format.
        orphan_events: lease lines for a request with no grant before them (log started late or
            the grant line was lost; skipped).
        regrants: grants of a request id that still had an open lease (a new lease is started).
    """

    leases: list[LeaseTimeline] = field(default_factory=list)
    open_leases: list[LeaseTimeline] = field(default_factory=list)
    late_reads: list[tuple[str, float]] = field(default_factory=list)
    bad_lines: int = 0
    other_lines: int = 0
    records: int = 0
    orphan_events: int = 0
    regrants: int = 0

    def first_late_reads(self) -> dict[str, float]:
        """``request_id -> epoch_s`` of its first late read (the shape ``checks.check_fail_closed`` takes)."""
        first: dict[str, float] = {}
        for rid, t in self.late_reads:
            first[rid] = min(t, first.get(rid, t))
        return first

    def to_json(self) -> dict:
        """JSON-ready counts, late reads and leases (times relative to each grant)."""
        return {
            "leases": [t.to_json() for t in self.leases],
            "open_leases": [t.to_json() for t in self.open_leases],
            "late_reads": [{"request_id": r, "epoch_s": t} for r, t in self.late_reads],
            "bad_lines": self.bad_lines,
            "other_lines": self.other_lines,
            "records": self.records,
            "orphan_events": self.orphan_events,
            "regrants": self.regrants,
        }


@dataclass
class _Worker:
    heartbeats: list[float] = field(default_factory=list)
    extension_logged: int | None = None
    expired_s: float | None = None
    retrievals: int = 0


@dataclass
class _Lease:
    rid: str
    grant_s: float
    grant_pid: int
    ttl_logged: int
    workers: dict[int, _Worker] = field(default_factory=dict)
    finished_s: float | None = None
    late_reads: list[tuple[int, float]] = field(default_factory=list)

    def worker(self, pid: int) -> _Worker:
        return self.workers.setdefault(pid, _Worker())


def _logged_or(value: float, logged: int | None) -> float:
    """The caller's value, unless vLLM's ``%d`` of the value it really ran with disagrees."""
    if logged is None or int(value) == logged:
        return float(value)
    return float(logged)


def parse_stock_lease_log(
    text_or_lines: str | bytes | Iterable[str | bytes], *, lease_duration_s: float, extension_s: float,
    served: Iterable[str] | None = None,
) -> StockLogResult:
    """Rebuild per-request lease timelines from stock vLLM 0.32.0 P log lines.

    The lines must be written with the format of
    :func:`~leasekit.telemetry.vllm_logconfig.write_logging_config` (any prefix before the
    ``(process pid=N)`` part is tolerated). Lines of several processes may interleave: records are
    ordered by their epoch time (``t=``), then by position. One :class:`LeaseTimeline` is built per
    grant and per P worker process that logged a heartbeat or an expiry for it (for a lease no
    worker mentioned: per worker process of the same engine, else one with ``tp_rank`` 0).

    Fields of each timeline (all times epoch seconds, P's wall clock):
        ``grant_s``: the scheduler's grant line. vLLM stamps the deadline on the scheduler's
        ``perf_counter`` right after it and workers rebase it (``pull_worker.py: start_load_kv``),
        so the worker's deadline is later by the metadata broadcast latency (milliseconds): the
        premature-reclaim test is that much looser, the upper bound that much tighter.
        ``heartbeats_s``: that worker's heartbeat lines. ``deadline_s = max(grant + L, last
        heartbeat + E)``. ``end_s``/``outcome``: see the module's release rule. ``lease_duration_s``
        / ``extension_s``: the caller's ``L`` / ``E`` unless the ``%d`` vLLM logged differs from
        ``int()`` of it, then the logged value (so the checks see that P ran with another ``L``).
        ``retrievals``: the expiry line's count; 0 when not logged (releases). ``kv_blocks``,
        ``step_gap_s``, ``remote_agent``: None (not logged). ``engine_id``: from the
        "Initializing NIXL worker/Scheduler" lines, "" if absent. ``tp_rank``: ``_TP<n>`` in the
        worker's process name (vLLM ``multiproc_executor.py``), else 0. ``events``: grant, extend,
        expire/release, ``release_inferred``, ``late_read``.

    Args:
        text_or_lines: the whole log (str or bytes) or an iterable of lines (an open file works).
        lease_duration_s: ``L`` P was started with (seconds).
        extension_s: ``E`` derived from it (seconds).
        served: request ids the caller knows D served (a mapping such as ``{id: answered_at}``
            works: its keys are used); applies the inferred-release rule (for logs written without
            the scheduler logger at DEBUG) to leases with no end line.

    Returns:
        A :class:`StockLogResult`. Malformed lines are counted and skipped; nothing raises on input.
    """
    result = StockLogResult()
    records: list[LogRecord] = []
    proc_by_pid: dict[int, str] = {}
    engine_by_pid: dict[int, str] = {}
    horizon: float | None = None
    for index, line in enumerate(split_lines(text_or_lines)):
        parsed = parse_line(line, index)
        if parsed is None:
            if is_evidence(line):
                result.bad_lines += 1
            else:
                result.other_lines += 1
            continue
        result.records += 1
        horizon = parsed.t if horizon is None else max(horizon, parsed.t)
        # The latest name wins: vLLM renames a process once it is decorated ("Worker_TP1").
        proc_by_pid[parsed.pid] = parsed.proc
        if not parsed.kind:
            continue
        if parsed.kind == "engine":
            engine_by_pid[parsed.pid] = parsed.rid
        else:
            records.append(parsed)
    records.sort(key=lambda r: (r.t, r.index))

    current: dict[str, _Lease] = {}
    all_leases: list[_Lease] = []
    for r in records:
        lease = current.get(r.rid)
        if r.kind == "grant":
            if lease is not None and lease.finished_s is None and not any(
                w.expired_s is not None for w in lease.workers.values()
            ):
                result.regrants += 1
            lease = _Lease(r.rid, r.t, r.pid, r.number)
            current[r.rid] = lease
            all_leases.append(lease)
            continue
        if r.kind == "late_read":
            result.late_reads.append((r.rid, r.t))
            if lease is not None:
                lease.late_reads.append((r.pid, r.t))
            continue
        if lease is None:
            result.orphan_events += 1
            continue
        if r.kind == "finished":
            if lease.finished_s is None:
                lease.finished_s = r.t
            continue
        w = lease.worker(r.pid)
        if lease.finished_s is not None or w.expired_s is not None:
            result.orphan_events += 1  # after the lease ended: vLLM logs neither then
            continue
        if r.kind == "heartbeat":
            w.heartbeats.append(r.t)
            if w.extension_logged is None:
                w.extension_logged = r.number
        elif r.kind == "expire":
            w.expired_s, w.retrievals = r.t, r.number

    served_ids = set(served) if served is not None else set()
    for lease in all_leases:
        pids: list[int | None] = list(lease.workers)
        if not pids:
            engine = engine_by_pid.get(lease.grant_pid)
            pids = [
                pid for pid, eid in engine_by_pid.items()
                if pid != lease.grant_pid and engine is not None and eid == engine
            ] or [None]
        for pid in pids:
            timeline = _timeline(
                lease, pid, lease.workers.get(pid, _Worker()) if pid is not None else _Worker(),
                lease_duration_s, extension_s, proc_by_pid, engine_by_pid, served_ids,
                horizon if horizon is not None else lease.grant_s,
            )
            (result.open_leases if timeline.outcome == OUTCOME_OPEN else result.leases).append(timeline)
    return result


def _timeline(
    lease: _Lease, pid: int | None, w: _Worker, lease_duration_s: float, extension_s: float,
    proc_by_pid: dict[int, str], engine_by_pid: dict[int, str], served: set[str], horizon: float,
) -> LeaseTimeline:
    L = _logged_or(lease_duration_s, lease.ttl_logged)
    E = _logged_or(extension_s, w.extension_logged)
    events: list[tuple[str, float]] = [(sc.EVENT_GRANT, lease.grant_s)]
    events += [(sc.EVENT_EXTEND, t) for t in w.heartbeats]
    last_hb = w.heartbeats[-1] if w.heartbeats else None
    if w.expired_s is not None:
        outcome, end = sc.OUTCOME_EXPIRED, w.expired_s
        events.append((sc.EVENT_EXPIRE, end))
    elif lease.finished_s is not None:
        outcome, end = sc.OUTCOME_RELEASED, lease.finished_s
        events.append((sc.EVENT_RELEASE, end))
    elif lease.rid in served:
        outcome, end = sc.OUTCOME_RELEASED, max([lease.grant_s, *w.heartbeats])
        events.append((EVENT_RELEASE_INFERRED, end))
    else:
        outcome, end = OUTCOME_OPEN, max(horizon, lease.grant_s)
    events += [(EVENT_LATE_READ, t) for p, t in lease.late_reads if pid is None or p == pid]
    events.sort(key=lambda e: e[1])
    proc = proc_by_pid.get(pid, "") if pid is not None else ""
    deadline = lease.grant_s + L if last_hb is None else max(lease.grant_s + L, last_hb + E)
    engine_id = engine_by_pid.get(pid) if pid is not None else None
    return LeaseTimeline(
        request_id=lease.rid,
        engine_id=engine_id or engine_by_pid.get(lease.grant_pid, ""),
        tp_rank=tp_rank_of(proc),
        kv_blocks=None,
        lease_duration_s=L,
        extension_s=E,
        grant_s=lease.grant_s,
        initial_deadline_s=lease.grant_s + L,
        heartbeats_s=tuple(w.heartbeats),
        heartbeat_count=len(w.heartbeats),
        last_heartbeat_s=last_hb,
        deadline_s=deadline,
        end_s=end,
        outcome=outcome,
        retrievals=w.retrievals,
        step_gap_s=None,
        remote_agent=None,
        events=tuple(events),
        stamp_latency_s=LOG_STAMP_LATENCY_S,
    )
