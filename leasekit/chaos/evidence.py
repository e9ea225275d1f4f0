"""Evidence for the checks: P's lease timelines and late reads, on one clock, per target.

- ``leasekit`` target: P's lease spans (``spans/*.jsonl``); times are P's ``perf_counter``.
- ``stock`` target: P's own vLLM log lines with millisecond epoch timestamps (the servers run with
  :func:`leasekit.telemetry.vllm_logconfig.write_logging_config`); times are P's wall clock.

Instants measured by the runner (a fault, an HTTP answer) are converted to that clock: to P's
monotonic clock by the measured time-namespace offset (P on another host: that host's clock read over
SSH plus P's offset read there; its spans and log are first copied here), or to the wall clock directly (same host;
if P runs under libfaketime its log clock is not the host's and the conversion is refused).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from leasekit.chaos.faults.onhost import monotonic_offset_on_host
from leasekit.cluster.clocks import to_process_monotonic
from leasekit.cluster.pair import PDPair
from leasekit.lease.config import LeaseTiming
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_timeline import LeaseTimeline, lease_timelines
from leasekit.telemetry.spanfile import read_span_dir
from leasekit.telemetry.vllm_log import parse_stock_lease_log


class ClockMismatch(RuntimeError):
    """The runner cannot place its instants on P's evidence clock (e.g. P's wall clock is faked)."""


@dataclass
class Evidence:
    """P's view of the workload's leases.

    Attributes:
        source: ``spans`` or ``vllm-log``.
        clock: ``monotonic`` (P's perf_counter) or ``wall`` (P's epoch seconds).
        leases: ended leases of the workload's requests.
        open_ids: workload requests with no ended lease.
        late_reads: request id -> when P saw a read completion after the lease had ended.
        discarded_reads: request id (P's) -> ``reaped`` | ``timeout``: reads LeaseKit D's read gate
            discarded (D's ``kv_lease_read`` spans; empty for the stock target).
        unparsable: span or log lines that could not be parsed.
    """

    source: str
    clock: str
    leases: list[LeaseTimeline] = field(default_factory=list)
    open_ids: list[str] = field(default_factory=list)
    late_reads: dict[str, float] = field(default_factory=dict)
    discarded_reads: dict[str, str] = field(default_factory=dict)
    unparsable: int = 0


READ_EVIDENCE_SETTLE_S = 10.0
"""Seconds the fail-closed check waits for the record of a read whose lease expired (spans reach their files
within a second; a remote host's are fetched again each try)."""


class EvidenceReader:
    """Reads evidence for ``target`` from ``pair`` and converts runner instants to its clock."""

    def __init__(self, pair: PDPair, target: str, timing: LeaseTiming):
        self.pair, self.target, self.timing = pair, target, timing

    @property
    def clock(self) -> str:
        return "monotonic" if self.target == "leasekit" else "wall"

    def read(self, request_ids: list[str]) -> Evidence:
        """Everything P recorded about ``request_ids`` so far."""
        wanted = set(request_ids)
        self.collect()
        if self.target == "leasekit":
            result = read_span_dir(self.pair.span_dir)
            leases = [l for l in lease_timelines(result.spans) if l.request_id in wanted]
            late, discarded = {}, {}
            for span in result.spans:
                rid = span.attributes.get(sc.REQUEST_ID)
                if rid not in wanted:
                    continue
                if span.name == sc.LATE_READ_SPAN_NAME:
                    late.setdefault(rid, float(span.attributes[sc.EV_MONOTONIC_S]))
                elif span.name == sc.READ_SPAN_NAME and span.attributes.get(sc.READ_OUTCOME) in sc.READ_DISCARDED_OUTCOMES:
                    discarded[rid] = str(span.attributes[sc.READ_OUTCOME])
            evidence = Evidence("spans", "monotonic", leases, late_reads=late, discarded_reads=discarded,
                                unparsable=result.bad_lines)
        else:
            text = self.pair.prefill.log_path.read_text(errors="replace") if self.pair.prefill.log_path.exists() else ""
            parsed = parse_stock_lease_log(text, lease_duration_s=self.timing.lease_duration_s, extension_s=self.timing.extension_s)
            leases = [l for l in parsed.leases if l.request_id in wanted]
            late = {rid: t for rid, t in parsed.first_late_reads().items() if rid in wanted}
            evidence = Evidence("vllm-log", "wall", leases, late_reads=late, unparsable=parsed.bad_lines)
        ended = {l.request_id for l in evidence.leases}
        evidence.open_ids = [rid for rid in request_ids if rid not in ended]
        return evidence

    def settle_reads(self, evidence: Evidence, request_ids: list[str], served: set[str]) -> Evidence:
        """``evidence``, read again every 0.5 s (up to :data:`READ_EVIDENCE_SETTLE_S` seconds) until every
        request of ``served`` whose lease expired has its read's record (P's late read, or D's discard). D writes
        its read-gate span when it decides the read, moments before the recompute is served, so evidence read
        right after the load finished can miss it."""
        deadline = time.monotonic() + READ_EVIDENCE_SETTLE_S
        while time.monotonic() < deadline:
            expired = {l.request_id for l in evidence.leases if l.outcome == "expired"} & served
            if all(rid in evidence.late_reads or rid in evidence.discarded_reads for rid in expired):
                break
            time.sleep(0.5)
            evidence = self.read(request_ids)
        return evidence

    def collect(self) -> None:
        """Bring the evidence here from servers on other hosts: for the LeaseKit target the span files
        of P and of D (``spans/`` of each one's run directory there, into :attr:`PDPair.span_dir`, where
        a pair on this machine writes them all: P's lease spans, D's read-gate spans that say which late
        reads D discarded); for the stock target P's log (into its ``log_path``)."""
        for server in (self.pair.prefill, self.pair.decode) if self.target == "leasekit" else (self.pair.prefill,):
            host = getattr(server, "host", None)
            if host is None or host.closed:
                continue
            if self.target == "leasekit":
                rc, out, _ = host.run(["find", f"{server.run_dir}/spans", "-type", "f"], timeout_s=60)
                for path in out.split() if rc == 0 else []:
                    host.fetch(path, self.pair.span_dir / path.rsplit("/spans/", 1)[1])
            else:
                server.fetch_log()

    def p_clock_offset_s(self) -> float | None:
        """P's monotonic clock minus this process's ``time.monotonic()``, seconds, when P runs on
        another host: the host's clock (:meth:`Host.perf_counter`) plus P's time-namespace offset read
        there (``/proc/<pid>/timens_offsets``); None when P runs here."""
        server = self.pair.prefill
        host = getattr(server, "host", None)
        if host is None:
            return None
        pgid = server.api_server_pid()
        if pgid is None:
            raise ClockMismatch(f"P is gone from host {host.name}: cannot read its time-namespace offset")
        cached = getattr(self, "_p_offset", None)
        if cached is not None and cached[0] == pgid:  # one P process: one offset
            return cached[1]
        namespace = monotonic_offset_on_host(host, pgid)
        if namespace is None:
            raise ClockMismatch(f"P is gone from host {host.name}: cannot read its time-namespace offset")
        self._p_offset = (pgid, host.perf_counter().offset_s + namespace)
        return self._p_offset[1]

    def wait_ended(self, request_ids: list[str], timeout_s: float) -> Evidence:
        """Poll until every request's lease ended or ``timeout_s`` passed; the last evidence."""
        deadline = time.monotonic() + timeout_s
        while True:
            evidence = self.read(request_ids)
            if not evidence.open_ids or time.monotonic() >= deadline:
                return evidence
            time.sleep(0.25)

    def to_p_clock(self, runner_monotonic_s: float, runner_wall_s: float) -> float:
        """Convert an instant the runner measured (both of its clocks) to P's evidence clock.

        Raises:
            ClockMismatch: P's wall clock is faked (libfaketime), or P is gone for the offset read.
        """
        if self.clock == "wall":
            if self.pair.spec.prefill_wall_offset_s or self.pair.spec.prefill_wall_rate != 1.0:
                raise ClockMismatch("P runs under libfaketime: its log timestamps are not the host's wall clock")
            return runner_wall_s
        offset = self.p_clock_offset_s()
        if offset is not None:  # P on another host: its clock, read there
            return runner_monotonic_s + offset
        pid = self.pair.prefill.api_server_pid()
        if pid is None and getattr(self.pair, "shares_host_clock", False):
            return runner_monotonic_s  # an external P on this host, in its time namespace
        if pid is None:
            raise ClockMismatch("P's server process is not running here (an external P on another host has another clock)")
        try:
            return to_process_monotonic(runner_monotonic_s, pid)
        except ProcessLookupError as exc:
            raise ClockMismatch(f"P is gone: cannot read its time-namespace offset ({exc})") from None
