"""The runner: start the pair, check the steady state, inject the fault, check the bound, report.

Chaos Toolkit's shape: steady-state hypothesis, method (the fault), rollbacks (teardown). An
interrupted run (SIGINT/SIGTERM) still tears down every process it started and writes
``report.json`` with ``"status": "interrupted"`` and whatever it had measured.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rich.console import Console

from leasekit import __version__
from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.checks import CheckResult, check_bounded_reclaim, check_steady_state
from leasekit.chaos.faults import KillFault
from leasekit.chaos.leases import LeaseTimeline, read_leases
from leasekit.chaos.report import make_console, print_report, write_json
from leasekit.chaos.scenario import Scenario
from leasekit.chaos.workload import QueuedDecodeLoad
from leasekit.cluster.clocks import to_process_monotonic
from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.lease.config import lint_timing


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


@contextmanager
def signals_deferred(*, raise_after: bool) -> Iterator[list[str]]:
    """Hold SIGINT/SIGTERM until the block ends (a kill in flight, or teardown, must finish).

    Yields the list of signal names received meanwhile. With ``raise_after`` a held signal is
    re-raised as KeyboardInterrupt when the block ends; otherwise it is only reported.
    """
    received: list[str] = []

    def _hold(signum, frame):  # noqa: ARG001
        received.append(signal.Signals(signum).name)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, _hold)
    try:
        yield received
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if raise_after and received:
        raise KeyboardInterrupt(f"signal {received[0]}")


@contextmanager
def interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt (SIGINT already is) for the duration of the block."""

    def _raise(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    saved = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)


@dataclass
class Phase:
    """One phase of a run (steady-state or fault) and what it measured."""

    name: str
    request_ids: list[str] = field(default_factory=list)
    started_monotonic_s: float | None = None
    fault: dict = field(default_factory=dict)
    check: CheckResult | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "request_ids": self.request_ids,
            "started_monotonic_s": self.started_monotonic_s,
            "fault": self.fault or None,
            "verdict": None if self.check is None else self.check.verdict,
            "check": None if self.check is None else self.check.to_json(),
            "notes": self.notes,
        }


class ScenarioRun:
    """Run one scenario against a real pair.

    Args:
        scenario: the validated scenario.
        run_dir: where the pair's logs and spans and ``report.json`` go.
        console: progress and report output (stderr by default for progress).
        start_timeout_s: per-server start timeout.
    """

    def __init__(self, scenario: Scenario, run_dir: str | Path, *, console: Console | None = None,
                 start_timeout_s: float = 300.0):
        self.scenario = scenario
        self.run_dir = Path(run_dir).resolve()
        if console is None:
            console = Console(stderr=True, log_path=False)
            if not console.is_terminal:
                console = Console(stderr=True, log_path=False, width=160)
        self.console = console
        self.start_timeout_s = start_timeout_s
        self.timing = scenario.lease.timing()
        self.phases: list[Phase] = []
        self.pair: PDPair | None = None
        self.status = "running"
        self.error: str | None = None
        self.interrupt_signal: str | None = None
        self._loads: list[QueuedDecodeLoad] = []
        self._bad_reported = 0
        self.started_at = _now_iso()

    # -- progress --------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        self.console.log(message)

    # -- evidence --------------------------------------------------------------------------
    def _leases(self) -> list[LeaseTimeline]:
        if self.pair is None:
            return []
        leases, bad = read_leases(self.pair.span_dir)
        if bad and bad != self._bad_reported:
            self._bad_reported = bad
            self._say(f"[yellow]{bad} unparsable span line(s) skipped[/]")
        return leases

    def _wait_leases_ended(self, request_ids: list[str], timeout_s: float) -> list[LeaseTimeline]:
        deadline = time.monotonic() + timeout_s
        wanted = set(request_ids)
        while True:
            leases = self._leases()
            if wanted <= {lease.request_id for lease in leases} or time.monotonic() >= deadline:
                return leases
            time.sleep(0.25)

    # -- phases ----------------------------------------------------------------------------
    def _workload(self) -> QueuedDecodeLoad:
        assert self.pair is not None
        w = self.scenario.workload
        load = QueuedDecodeLoad(self.pair, w.requests, w.prompt_tokens, w.decode_tokens)
        self._loads.append(load)
        return load

    def _steady_state(self) -> Phase:
        phase = Phase("steady-state", started_monotonic_s=time.monotonic())
        self.phases.append(phase)
        hold_s = self.scenario.hold_decode_slot_s()
        self._say(f"steady state: {self.scenario.workload.requests} request(s) queued on D for {hold_s:.1f} s, no fault")
        load = self._workload()
        try:
            load.start()
        finally:
            phase.request_ids = load.request_ids
        assert load.queued_at is not None
        time.sleep(max(0.0, load.queued_at + hold_s - time.monotonic()))
        load.release_slot()
        if not load.wait_decodes(120):
            phase.notes.append("not every decode finished within 120 s")
        leases = self._wait_leases_ended(phase.request_ids, 30)
        ss = self.scenario.steady_state
        phase.check = check_steady_state(
            leases, phase.request_ids, load.decodes, self.timing,
            expiries_allowed=ss.expiries, all_served=ss.all_served,
        )
        self._say(f"steady state: {phase.check.verdict} - {phase.check.summary}")
        return phase

    def _fault(self) -> Phase:
        assert self.pair is not None
        phase = Phase("fault", started_monotonic_s=time.monotonic())
        self.phases.append(phase)
        fault_spec = self.scenario.faults[0]
        target = self.pair.decode if fault_spec.target == "decode" else self.pair.prefill
        load = self._workload()
        self._say(f"fault run: {self.scenario.workload.requests} request(s) queued on D")
        try:
            load.start()
        finally:
            phase.request_ids = load.request_ids
        assert load.queued_at is not None
        time.sleep(max(0.0, load.queued_at + self.scenario.kill_after_s() - time.monotonic()))
        fault = KillFault(target, signal.Signals[fault_spec.signal])
        self._say(f"fault: {fault_spec.signal} to {target.spec.name}'s process group")
        phase.fault = fault.record  # filled in place by inject(), before the signal goes out
        with signals_deferred(raise_after=True):  # a Ctrl-C now must not lose the record of the kill
            fault.inject()
            phase.fault["queued_monotonic_s"] = load.queued_at
            phase.fault["at_prefill_monotonic_s"] = self._fault_on_prefill_clock(phase)
        if fault.record.get("survivors"):
            phase.notes.append(f"processes survived the kill: {fault.record['survivors']}")
        L, E = float(self.timing.lease_duration_s), float(self.timing.extension_s)
        wait_s = max(L, E) + self.scenario.lease.tick_s + 20.0
        self._say(f"waiting up to {wait_s:.0f} s for P to reclaim {len(phase.request_ids)} lease(s)")
        leases = self._wait_leases_ended(phase.request_ids, wait_s)
        phase.check = check_bounded_reclaim(
            leases, phase.request_ids, self.timing, self.scenario.lease.tick_s,
            fault_at_s=phase.fault["at_prefill_monotonic_s"], waited_s=wait_s,
        )
        self._say(f"fault run: {phase.check.verdict} - {phase.check.summary}")
        return phase

    def _fault_on_prefill_clock(self, phase: Phase) -> float | None:
        """The fault instant converted to P's monotonic clock by the measured namespace offset."""
        assert self.pair is not None and self.pair.prefill.proc is not None
        injected = phase.fault.get("injected_monotonic_s")
        if injected is None:
            return None
        try:
            return to_process_monotonic(injected, self.pair.prefill.proc.pid)
        except ProcessLookupError:
            return None

    def _partial_checks(self) -> None:
        """After an interruption: evaluate whatever leases ended so far (no waiting)."""
        leases = self._leases()
        for phase in self.phases:
            if phase.check is not None or not phase.request_ids:
                continue
            if phase.name == "fault" and phase.fault:
                phase.fault.setdefault("at_prefill_monotonic_s", self._fault_on_prefill_clock(phase))
                phase.check = check_bounded_reclaim(
                    leases, phase.request_ids, self.timing, self.scenario.lease.tick_s,
                    fault_at_s=phase.fault["at_prefill_monotonic_s"], partial=True,
                )
            phase.notes.append("interrupted before this phase finished; evidence is partial")

    # -- the run ---------------------------------------------------------------------------
    def verdict(self) -> str:
        """PASS only if the run completed and every phase passed; FAIL if any failed; else UNKNOWN."""
        verdicts = [p.check.verdict if p.check else UNKNOWN for p in self.phases]
        if FAIL in verdicts:
            return FAIL
        if self.status == "completed" and verdicts and all(v == PASS for v in verdicts):
            return PASS
        return UNKNOWN

    def report(self) -> dict:
        """The JSON report (also valid for an interrupted or failed run)."""
        s = self.scenario
        return {
            "leasekit_version": __version__,
            "scenario": s.name,
            "incident": s.incident,
            "description": s.description,
            "status": self.status,
            "verdict": self.verdict(),
            "expected_verdict": s.expect.verdict,
            "as_expected": self.status == "completed" and self.verdict() == s.expect.verdict,
            "lint": lint_timing(self.timing),
            "error": self.error,
            "started_at": self.started_at,
            "finished_at": _now_iso(),
            "run_dir": str(self.run_dir),
            "report_path": str(self.run_dir / "report.json"),
            "targets": {"prefill": s.topology.prefill_connector, "decode": s.topology.decode_connector},
            "config": {
                "lease_duration_s": self.timing.lease_duration_s,
                "heartbeat_interval_s": self.timing.heartbeat_interval_s,
                "extension_s": self.timing.extension_s,
                "tick_s": s.lease.tick_s,
                "requests": s.workload.requests,
                "hold_decode_slot_s": s.hold_decode_slot_s(),
                "kill_after_queued_s": s.kill_after_s(),
            },
            "clock": "P's time.perf_counter (CLOCK_MONOTONIC); lease times are seconds after each grant",
            "startup_s": None if self.pair is None else self.pair.startup_s,
            "phases": [p.to_json() for p in self.phases],
            "logs": None if self.pair is None else {
                "prefill": str(self.pair.prefill.log_path), "decode": str(self.pair.decode.log_path)},
        }

    def execute(self) -> dict:
        """Run every phase, tear down, write and print the report; returns the report dict."""
        s = self.scenario
        try:
            with interrupts_as_keyboard_interrupt():
                spec = PairSpec.pinned(
                    prefill_connector=s.topology.prefill_connector,
                    decode_connector=s.topology.decode_connector,
                    lease_duration_s=self.timing.lease_duration_s,
                    decode_max_num_seqs=s.topology.decode_max_num_seqs,
                )
                self.pair = PDPair(spec, self.run_dir, start_timeout_s=self.start_timeout_s)
                for finding in lint_timing(self.timing):
                    self._say(f"[yellow]lint: {finding}[/]")
                self._say(
                    f"starting P ({s.topology.prefill_connector}) and D ({s.topology.decode_connector}) "
                    f"with L={self.timing.lease_duration_s} s (engines take 20-60 s); logs in {self.run_dir / 'logs'}"
                )
                self.pair.start()
                self._say(f"pair up in {max(self.pair.startup_s.values()):.0f} s and warmed up")
                self._steady_state()
                self._fault()
                self.status = "completed"
        except KeyboardInterrupt as exc:
            self.status = "interrupted"
            self.interrupt_signal = "SIGTERM" if "SIGTERM" in str(exc) else "SIGINT"
            self.error = f"interrupted ({self.interrupt_signal})"
        except Exception as exc:  # noqa: BLE001 - every failure still gets a report and a teardown
            self.status = "error"
            self.error = f"{type(exc).__name__}: {exc}"
            self.console.print(traceback.format_exc(), markup=False, highlight=False)
        finally:
            with signals_deferred(raise_after=False):
                if self.status != "completed":
                    try:
                        self._partial_checks()
                    except Exception as exc:  # noqa: BLE001
                        self.error = f"{self.error}; partial evidence unreadable: {exc}"
                for load in self._loads:
                    load.release_slot()
                if self.pair is not None:
                    self._say("tearing down the pair (up to 10 s)")
                    self.pair.stop()
                report = self.report()
                try:
                    write_json(self.run_dir / "report.json", report)
                except OSError as exc:
                    self.error = f"{self.error + '; ' if self.error else ''}could not write report.json: {exc}"
                    report["error"] = self.error
        print_report(report, [p.check for p in self.phases if p.check is not None], make_console())
        if self.error:
            self.console.print(f"[red]{self.error}[/]")
        return report
