"""The lease lines of stock vLLM's own log, one record at a time (the grammar
:func:`leasekit.telemetry.vllm_log.parse_stock_lease_log` assembles into lease timelines).

Records are lines in :data:`leasekit.telemetry.vllm_logconfig.LOG_FORMAT` (any prefix before the
``(process pid=N)`` part is tolerated). The log lines read (vllm 0.32.0; files under
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` unless named otherwise), with the process
that writes them:

* grant (EngineCore, the scheduler): ``NIXLConnector request_finished(%s) waiting for %d seconds
  before releasing blocks`` (DEBUG, ``pull_scheduler.py: request_finished``; the deadline
  ``perf_counter() + L`` is stamped right after it); in push mode (vLLM's NixlPushConnector) the same
  line begins ``NixlPushConnector request_finished(%s)`` (DEBUG, ``push_scheduler.py: request_finished``).
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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from leasekit.telemetry.vllm_logconfig import DEFAULT_DEBUG_LOGGERS

KINDS = ("grant", "heartbeat", "expire", "late_read", "finished", "engine")
"""The kinds of lease record, one per line above (``finished``: blocks freed; ``engine``: engine id)."""

_HEADER_RE = re.compile(
    r"\((?P<proc>[^()]+?) pid=(?P<pid>\d+)\) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<date>\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) t=(?P<t>\S+) (?P<logger>\S+) "
    r"\[(?P<file>[^\]\s]*):(?P<lineno>\d+)\] (?P<msg>.*)"
)
_GRANT_RE = re.compile(
    r"(?:NIXLConnector|NixlPushConnector) request_finished\((?P<rid>.+)\) waiting for (?P<ttl>-?\d+) seconds before releasing blocks"
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


@dataclass
class LogRecord:
    """One line in the log format.

    Attributes:
        t: the record's epoch seconds (``t=``: ``time.time()`` at the logging call, P's wall clock).
        index: the line's position in the input (0-based; orders records logged at the same ``t``).
        pid / proc: the writing process and its name (``EngineCore_DP0``, ``Worker_TP1``).
        kind: one of :data:`KINDS`, or ``""`` for a record that carries no lease evidence.
        rid: the request id (the engine id for ``engine``); "" otherwise.
        number: the logged ``%d``: ``L`` of a grant, ``E`` of a heartbeat, the retrievals of an
            expiry; 0 otherwise.
    """

    t: float
    index: int
    pid: int
    proc: str
    kind: str = ""
    rid: str = ""
    number: int = 0


def parse_line(line: str, index: int) -> LogRecord | None:
    """The record ``line`` holds (``index``: its position in the input); None for a line not in the
    log format, or a lease line whose fields do not parse (tell the two apart with :func:`is_evidence`)."""
    head = _HEADER_RE.search(line)
    if head is None:
        return None
    try:
        t = float(head["t"])
    except ValueError:
        return None
    if not math.isfinite(t):
        return None
    msg = head["msg"].rstrip("\r\n")
    record = LogRecord(t, index, int(head["pid"]), head["proc"])

    def lease(kind: str, rid: str = "", number: int = 0) -> LogRecord:
        record.kind, record.rid, record.number = kind, rid, number
        return record

    if m := _HEARTBEAT_RE.fullmatch(msg):
        try:
            float(m["old"]), float(m["new"])
        except ValueError:
            return None
        return lease("heartbeat", m["rid"], int(m["ext"]))
    if m := _GRANT_RE.fullmatch(msg):
        return lease("grant", m["rid"], int(m["ttl"]))
    if m := _EXPIRE_RE.fullmatch(msg):
        return lease("expire", m["rid"], int(m["n"]))
    if m := _LATE_READ_RE.fullmatch(msg):
        return lease("late_read", m["rid"])
    if m := _FINISHED_RE.fullmatch(msg):
        return lease("finished", m["rid"])
    if m := _ENGINE_RE.fullmatch(msg):
        return lease("engine", m["eid"])
    if any(marker in msg for marker in _MARKERS):
        return None
    return record


def is_evidence(line: str) -> bool:
    """Whether a line :func:`parse_line` refused still holds lease evidence (a lease line cut short or
    with a garbled header: count it as bad), rather than being another program's line."""
    return any(marker in line for marker in _EVIDENCE)


def tp_rank_of(proc: str) -> int:
    """The TP rank in a worker's process name (``_TP<n>``, vLLM ``multiproc_executor.py``); 0 if none."""
    tp = _TP_RE.search(proc)
    return int(tp.group(1)) if tp else 0


def split_lines(text_or_lines: str | bytes | Iterable[str | bytes]) -> Iterable[str]:
    """The lines of a whole log (str or bytes) or of an iterable of chunks (an open file works); bytes
    are decoded as UTF-8 with replacement, and a chunk holding several lines (vLLM's
    ``NewLineFormatter`` joins with ``"\\r\\n"``) is split."""
    if isinstance(text_or_lines, bytes):
        text_or_lines = text_or_lines.decode("utf-8", errors="replace")
    if isinstance(text_or_lines, str):
        yield from text_or_lines.splitlines()
        return
    for chunk in text_or_lines:
        if isinstance(chunk, bytes):
            chunk = chunk.decode("utf-8", errors="replace")
        yield from str(chunk).splitlines() or [""]
