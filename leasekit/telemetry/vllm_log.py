"""Lease evidence from stock vLLM's own log lines (the stock-NixlConnector chaos target).

Stock vLLM emits no lease spans, but P's connector logs every lease transition. Launch the servers
with the logging config of :func:`write_logging_config` (env ``VLLM_LOGGING_CONFIG_PATH``) and
:func:`parse_stock_lease_log` rebuilds the same :class:`~leasekit.chaos.leases.LeaseTimeline`
objects the span path produces, so the chaos checks run unchanged on either target.

The log lines read (vllm 0.32.0; files under ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``
unless named otherwise), with the process that writes them:

* grant (EngineCore, the scheduler): ``NIXLConnector request_finished(%s) waiting for %d seconds
  before releasing blocks`` (DEBUG, ``pull_scheduler.py: request_finished``; the deadline
  ``perf_counter() + L`` is stamped right after it).
* heartbeat (Worker, one process per TP rank): ``Heartbeat extended lease for request %s by %ds
  (old_expiry=%.1f, new_expiry=%.1f)`` (DEBUG, ``base_worker.py: _handle_heartbeat``; logged for
  every delivered heartbeat naming a held lease, also when ``max(old, now + E)`` keeps ``old``).
* expiry (Worker): ``Releasing expired KV blocks for request %s which were retrieved by %d remote
  worker(s) before lease expired.`` (WARNING, ``base_worker.py: _reap_expired_send_leases``).
* late read (Worker): ``Potentially invalid KV blocks for unrecognized request %s were retrieved by
  a decode worker. They may have expired.`` (ERROR, ``pull_worker.py: _get_new_notifs``).
* blocks freed (EngineCore): ``Finished sending KV transfer for request %s`` (DEBUG,
  ``vllm/v1/core/sched/scheduler.py: _update_from_kv_xfer_finished``; once every worker reported
  the request done, by read completion or by expiry).
* engine id: ``Initializing NIXL worker %s`` (INFO, ``base_worker.py``, Worker) and
  ``Initializing NIXL Scheduler %s`` (INFO, ``base_scheduler.py``, EngineCore).

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

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from leasekit.chaos.leases import LeaseTimeline
from leasekit.telemetry import semconv as sc

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

GRANT_LOGGER = f"{_NIXL}.pull_scheduler"
"""Logger of the grant line (``init_logger(__name__)`` in ``nixl/pull_scheduler.py``)."""

WORKER_LOGGER = f"{_NIXL}.base_worker"
"""Logger of the heartbeat and expiry lines (``nixl/base_worker.py``)."""

PULL_WORKER_LOGGER = f"{_NIXL}.pull_worker"
"""Logger of the late-read line (``nixl/pull_worker.py``)."""

RELEASE_LOGGER = "vllm.v1.core.sched.scheduler"
"""Logger of "Finished sending KV transfer" (``vllm/v1/core/sched/scheduler.py``): the direct
evidence of a release. Six DEBUG calls in all, none per step on P, so DEBUG costs little."""

LEASE_LOGGERS = (GRANT_LOGGER, WORKER_LOGGER, PULL_WORKER_LOGGER)
"""The loggers that carry the lease events proper."""

DEFAULT_DEBUG_LOGGERS = (*LEASE_LOGGERS, RELEASE_LOGGER)
"""Loggers :func:`write_logging_config` sets to DEBUG by default; every other stays INFO."""

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

DATE_FORMAT = "%m-%d %H:%M:%S"
"""vLLM's default ``datefmt`` (``vllm/logger.py: _DATE_FORMAT``)."""

LOG_FORMAT = (
    "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s.%(msecs)03d "
    "t=%(created).6f %(name)s [%(fileinfo)s:%(lineno)d] %(message)s"
)
"""vLLM's default format (``vllm/logger.py: _FORMAT``) plus milliseconds, the record's epoch seconds
(``t=``, ``time.time()`` at the call: P's wall clock, microsecond resolution) and the logger name."""

_HEADER_RE = re.compile(
    r"\((?P<proc>[^()]+?) pid=(?P<pid>\d+)\) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<date>\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) t=(?P<t>\S+) (?P<logger>\S+) "
    r"\[(?P<file>[^\]\s]*):(?P<lineno>\d+)\] (?P<msg>.*)"
)
_GRANT_RE = re.compile(
    r"NIXLConnector request_finished\((?P<rid>.+)\) waiting for (?P<ttl>-?\d+) seconds before releasing blocks"
)
_HEARTBEAT_RE = re.compile(
    r"Heartbeat extended lease for request (?P<rid>.+) by (?P<ext>-?\d+)s "
    r"\(old_expiry=(?P<old>[^,\s]+), new_expiry=(?P<new>[^)\s]+)\)"
)
_EXPIRE_RE = re.compile(
    r"Releasing expired KV blocks for request (?P<rid>.+) which were retrieved by (?P<n>\d+) "
    r"remote worker\(s\) before lease expired\."
)
_LATE_READ_RE = re.compile(
    r"Potentially invalid KV blocks for unrecognized request (?P<rid>.+) were retrieved by a decode "
    r"worker\. They may have expired\."
)
_FINISHED_RE = re.compile(r"Finished sending KV transfer for request (?P<rid>.+)")
_ENGINE_RE = re.compile(r"Initializing NIXL (?P<who>worker|Scheduler) (?P<eid>\S+)")
_TP_RE = re.compile(r"_TP(\d+)(?:_|$)")

_MARKERS = (
    "before releasing blocks",
    "Heartbeat extended lease",
    "Releasing expired KV blocks",
    "Potentially invalid KV blocks",
    "Finished sending KV transfer",
)
"""A record whose message contains one of these is lease evidence: unparsable, it counts as bad."""


_EVIDENCE = (*_MARKERS, *(f" {name} " for name in DEFAULT_DEBUG_LOGGERS))
"""A line that is not a whole record but holds one of these (a lease line cut short, a garbled
header) counts as bad, not as a foreign line."""


def logging_config(
    *, stream: str = "ext://sys.stdout", prefix: str = "", debug_loggers: Iterable[str] = DEFAULT_DEBUG_LOGGERS
) -> dict:
    """The ``logging.config.dictConfig`` dict :func:`write_logging_config` writes.

    vLLM's ``DEFAULT_LOGGING_CONFIG`` (vllm 0.32.0 ``vllm/logger.py``) with only these changes: the
    format is :data:`LOG_FORMAT`, the handler passes DEBUG, and ``debug_loggers`` are set to DEBUG
    (they propagate to the ``vllm`` logger's handler); the ``vllm`` logger stays INFO. The
    formatter is vLLM's ``NewLineFormatter`` (continuation lines repeat the prefix) and the handler
    keeps the name ``vllm`` (``vllm/logger.py: current_formatter_type`` looks it up by name).

    Args:
        stream: the handler's stream, as ``VLLM_LOGGING_STREAM`` (default ``ext://sys.stdout``).
        prefix: ``VLLM_LOGGING_PREFIX`` to put before every line (the parser tolerates any prefix).
        debug_loggers: logger names to set to DEBUG.
    """
    fmt = {
        "()": "vllm.logging_utils.NewLineFormatter",
        "datefmt": DATE_FORMAT,
        "format": prefix + LOG_FORMAT,
        # "INFO" as in vLLM's default: [file.py:line] rather than a relative path.
        "log_level": "INFO",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": fmt},
        "handlers": {
            "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "DEBUG", "stream": stream},
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            **{name: {"level": "DEBUG"} for name in debug_loggers},
        },
    }


def write_logging_config(
    path: str | Path, *, stream: str = "ext://sys.stdout", prefix: str = "",
    debug_loggers: Iterable[str] = DEFAULT_DEBUG_LOGGERS,
) -> Path:
    """Write the JSON logging config for vLLM servers whose P log :func:`parse_stock_lease_log` reads.

    Use it with ``VLLM_LOGGING_CONFIG_PATH=<path>`` (vLLM loads it with ``json.loads`` +
    ``dictConfig`` in every process: API server, EngineCore, workers; ``vllm/logger.py:
    _configure_vllm_root_logger``). A custom config replaces vLLM's default entirely, so
    ``VLLM_LOGGING_LEVEL`` no longer applies; ``VLLM_CONFIGURE_LOGGING`` must stay 1 (vLLM raises
    otherwise). See :func:`logging_config` for the content and the arguments.

    Returns:
        ``path`` as a :class:`~pathlib.Path` (parent directories are created).

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = logging_config(stream=stream, prefix=prefix, debug_loggers=debug_loggers)
    out.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


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
        other_lines: lines not in :data:`LOG_FORMAT` (warnings, NIXL's own log, uvicorn; skipped).
        records: lines in :data:`LOG_FORMAT`.
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
class _Record:
    t: float
    index: int
    pid: int
    proc: str
    kind: str
    rid: str = ""
    number: int = 0


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


def _parse_line(line: str, index: int) -> _Record | None | bool:
    """A lease record; None for another record in our format; False for a line not in it."""
    head = _HEADER_RE.search(line)
    if head is None:
        return False
    try:
        t = float(head["t"])
    except ValueError:
        return False
    if not math.isfinite(t):
        return False
    msg = head["msg"].rstrip("\r\n")
    pid, proc = int(head["pid"]), head["proc"]

    def rec(kind: str, rid: str = "", number: int = 0) -> _Record:
        return _Record(t, index, pid, proc, kind, rid, number)

    if m := _HEARTBEAT_RE.fullmatch(msg):
        try:
            float(m["old"]), float(m["new"])
        except ValueError:
            return False
        return rec("heartbeat", m["rid"], int(m["ext"]))
    if m := _GRANT_RE.fullmatch(msg):
        return rec("grant", m["rid"], int(m["ttl"]))
    if m := _EXPIRE_RE.fullmatch(msg):
        return rec("expire", m["rid"], int(m["n"]))
    if m := _LATE_READ_RE.fullmatch(msg):
        return rec("late_read", m["rid"])
    if m := _FINISHED_RE.fullmatch(msg):
        return rec("finished", m["rid"])
    if m := _ENGINE_RE.fullmatch(msg):
        return rec("engine", m["eid"])
    if any(marker in msg for marker in _MARKERS):
        return False
    return None


def _lines(text_or_lines: str | bytes | Iterable[str | bytes]) -> Iterable[str]:
    if isinstance(text_or_lines, bytes):
        text_or_lines = text_or_lines.decode("utf-8", errors="replace")
    if isinstance(text_or_lines, str):
        yield from text_or_lines.splitlines()
        return
    for chunk in text_or_lines:
        if isinstance(chunk, bytes):
            chunk = chunk.decode("utf-8", errors="replace")
        # A chunk may itself hold several lines (NewLineFormatter joins with "\r\n").
        yield from str(chunk).splitlines() or [""]


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

    The lines must be written with :func:`write_logging_config`'s format (any prefix before the
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
    records: list[_Record] = []
    proc_by_pid: dict[int, str] = {}
    engine_by_pid: dict[int, str] = {}
    horizon: float | None = None
    for index, line in enumerate(_lines(text_or_lines)):
        parsed = _parse_line(line, index)
        if parsed is False:
            if any(marker in line for marker in _EVIDENCE):
                result.bad_lines += 1
            else:
                result.other_lines += 1
            continue
        result.records += 1
        head = _HEADER_RE.search(line)
        assert head is not None  # parsed is not False
        t = float(head["t"])
        horizon = t if horizon is None else max(horizon, t)
        # The latest name wins: vLLM renames a process once it is decorated ("Worker_TP1").
        proc_by_pid[int(head["pid"])] = head["proc"]
        if parsed is None:
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
    tp = _TP_RE.search(proc)
    deadline = lease.grant_s + L if last_hb is None else max(lease.grant_s + L, last_hb + E)
    engine_id = engine_by_pid.get(pid) if pid is not None else None
    return LeaseTimeline(
        request_id=lease.rid,
        engine_id=engine_id or engine_by_pid.get(lease.grant_pid, ""),
        tp_rank=int(tp.group(1)) if tp else 0,
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
