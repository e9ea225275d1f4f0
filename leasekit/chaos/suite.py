"""Run scenarios x targets: plan the order so pairs are shared, run each scenario, and write the
reports (terminal tables, ``report.json``, JUnit XML, one timeline PNG per scenario and target).

An interrupted suite (SIGINT/SIGTERM) stops the pair, undoes every fault, removes every namespace
and cgroup it made, and still writes the reports with ``"status": "interrupted"``.
"""

from __future__ import annotations

import datetime as dt
import signal
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console

from leasekit import __version__
from leasekit.chaos import FAIL, UNKNOWN
from leasekit.chaos.execute import ScenarioExecution
from leasekit.chaos.result import ScenarioResult
from leasekit.chaos.faults.netns import cleanup_stale_namespaces
from leasekit.chaos.faults.stall import cleanup_stale_cgroups
from leasekit.chaos.junit import write_junit
from leasekit.chaos.pool import PairPool, pair_spec
from leasekit.chaos.report import junit_cases, make_console, matrix_rows, print_results, write_json
from leasekit.chaos.scenario import Scenario
from leasekit.chaos.schema import KillFault


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


@contextmanager
def signals_deferred(*, raise_after: bool) -> Iterator[list[str]]:
    """Hold SIGINT/SIGTERM until the block ends (a kill in flight, or teardown, must finish).

    Yields the names of signals received meanwhile; with ``raise_after`` the first is re-raised
    as KeyboardInterrupt when the block ends.
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
    """Turn SIGTERM into KeyboardInterrupt (SIGINT already is) inside the block."""

    def _raise(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    saved = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)


def _teardown_hosts() -> None:
    """Stop the servers on other hosts and tear those hosts down (:func:`leasekit.cluster.remote.teardown_hosts`).

    Raises:
        RuntimeError: a host could not be torn down (its watchdog cleans it after ``stale_s``)."""
    from leasekit.cluster.remote import teardown_hosts

    problems = teardown_hosts()
    if problems:
        raise RuntimeError("; ".join(problems))


def _destructive(scenario: Scenario) -> bool:
    """The scenario kills a server (its pair is then restarted or dropped)."""
    return any(isinstance(f, KillFault) for f in scenario.faults)


def _leaves_decode_dead(scenario: Scenario) -> bool:
    """The scenario kills D and does not restart it itself."""
    return any(isinstance(f, KillFault) and f.target == "decode" and f.restart_after_s is None for f in scenario.faults)


def _left_d_dirty(result: ScenarioResult) -> bool:
    """The run left D with requests that never ended or KV blocks it never freed (a failed ``liveness`` or
    ``decode-conservation`` check): the next scenario gets a fresh pair, not one whose D still holds them."""
    return any(c.name in ("liveness", "decode-conservation") and c.verdict == FAIL for c in result.checks)


def plan(scenarios: list[Scenario], targets: list[str] | None = None) -> list[tuple[Scenario, str]]:
    """The run order: per target, scenarios sharing launch conditions together (plain pairs first),
    and within a group the ones that kill a server last."""
    runs = []
    for target in ("leasekit", "stock"):
        for scenario in scenarios:
            wanted = targets or list(scenario.topology.targets)
            if target in wanted and target in scenario.topology.targets:
                runs.append((scenario, target))
    def key(item):
        scenario, target = item
        spec = pair_spec(scenario, target)
        plain = spec.launch_key() == pair_spec(scenario.model_copy(update={"launch": type(scenario.launch)()}), target).launch_key()
        return (target != "leasekit", not plain, str(spec.launch_key()), _destructive(scenario), scenario.name)
    return sorted(runs, key=key)


def overall_verdict(results: list[ScenarioResult], status: str) -> str:
    """PASS when every run completed with its expected verdict; FAIL when a run FAILed unexpectedly, or
    PASSed (or failed other checks) where a known defect was expected; else UNKNOWN (an unexpected UNKNOWN,
    a harness error, a ``status`` other than ``completed``, no results)."""
    unexpected = [r for r in results if not r.as_expected]
    if any(r.verdict in (FAIL, "PASS") for r in unexpected):
        return FAIL
    if status != "completed" or not results or unexpected:
        return UNKNOWN
    return "PASS"


class Suite:
    """Runs planned scenarios; ``execute`` returns the report dict. ``deployment``: the pair file's
    servers (a :class:`leasekit.cluster.pairfile.PairFile`; None: the CPU default); ``pair_file``: its
    path as given (each result's ``pair_file``). Each result carries the vLLM release its pair reported
    when the scenario ended (``vllm_release``, :mod:`leasekit.cluster.vllmrelease`; after a D restart inside
    the scenario, the new D's; a partial result of an interrupted scenario keeps the one it started with)."""

    def __init__(self, runs: list[tuple[Scenario, str]], run_dir: str | Path, *, start_timeout_s: float = 300.0,
                 console: Console | None = None, pool=None, deployment=None, pair_file: str | None = None):
        self.runs = runs
        self.deployment = deployment
        self.pair_file = pair_file
        self.run_dir = Path(run_dir).resolve()
        if console is None:
            console = Console(stderr=True, log_path=False)
            if not console.is_terminal:
                console = Console(stderr=True, log_path=False, width=160)
        self.console = console
        self.pool = pool if pool is not None else PairPool(self.run_dir, start_timeout_s=start_timeout_s, say=self._say)
        self.results: list[ScenarioResult] = []
        self.status = "running"
        self.error: str | None = None
        self.interrupt_signal: str | None = None
        self.started_at = _now_iso()
        self._steady_cache: dict = {}
        self._current: ScenarioExecution | None = None
        self._pairless: list[ScenarioResult] = []

    def _say(self, message: str) -> None:
        self.console.log(message)

    def pair_spec(self, scenario: Scenario, target: str):
        """The :class:`leasekit.cluster.pair.PairSpec` of ``scenario`` on ``target`` in this suite's deployment."""
        return pair_spec(scenario, target, self.deployment)

    def run_one(self, scenario: Scenario, target: str) -> ScenarioResult:
        """Run one scenario on one target on a pair from the pool (started or reused); the result
        is also appended to :attr:`results`. A harness error becomes an UNKNOWN result whose
        summary starts with "harness error" (the pair is then stopped).

        Raises:
            KeyboardInterrupt: SIGINT/SIGTERM; call :meth:`abort` then :meth:`finish`.
        """
        try:
            result = self._run_one(scenario, target)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - one scenario's harness error is its verdict
            pair = getattr(self.pool, "current", None)  # the pair that failed, when it got as far as /version
            result = ScenarioResult(scenario.name, target, UNKNOWN, scenario.expect.verdict_for(target),
                                    f"harness error: {type(exc).__name__}: {exc}", incident=scenario.incident,
                                    mode=scenario.topology.transfer_mode, pair_file=self.pair_file,
                                    vllm_release=getattr(exc, "vllm_release", getattr(pair, "vllm_release", "unknown")))
            result.notes.append(traceback.format_exc())
            getattr(self.pool, "close_current", self.pool.close)()  # a pair warming up for later stays
        self.results.append(result)
        self._say(f"{scenario.name} / {target}: {result.verdict} (expected {result.expected}) - {result.summary}")
        return result

    def _run_one(self, scenario: Scenario, target: str) -> ScenarioResult:
        out = self.run_dir / "scenarios"
        out.mkdir(parents=True, exist_ok=True)
        if not _needs_pair(scenario, target):  # the fault cannot be injected here: UNKNOWN, no pair needed
            result = ScenarioExecution(scenario, target, None, out, say=self._say).execute()  # type: ignore[arg-type]
            result.pair_file = self.pair_file
            self._pairless.append(result)  # its release: the suite's, once known (_fill_releases)
            return result
        pair = self.pool.get(self.pair_spec(scenario, target))
        self._prefetch_after(scenario, target)
        execution = ScenarioExecution(scenario, target, pair, out, say=self._say, steady_cache=self._steady_cache)
        execution.result.vllm_release = getattr(pair, "vllm_release", "unknown")  # also on a partial result
        execution.result.pair_file = self.pair_file
        self._current = execution  # kept on KeyboardInterrupt: abort() and finish() need it
        try:
            result = execution.execute()
            result.vllm_release = getattr(pair, "vllm_release", result.vllm_release)  # as the scenario left it (D restarted)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._current = None
            raise
        self._current = None
        self.pool.release(reusable=(not _destructive(scenario) or scenario.launch.warm_up) and not _left_d_dirty(result))
        return result

    PREFETCH_PAIRS = 3
    """How many later pairs (distinct launch conditions, in plan order) start in the background."""

    def _prefetch_after(self, scenario: Scenario, target: str) -> None:
        """Let the pool start, as background work, what the planned runs after this one need: a
        spare D while a scenario that kills D is still to come on this pair (and is not the last
        one on it), and the next pairs; spares that are ready are parked (SIGSTOP)."""
        pool = self.pool
        if not hasattr(pool, "prefetch_pair"):
            return
        pool.park_ready_spares()
        names = [(s.name, t) for s, t in self.runs]
        if (scenario.name, target) not in names:
            return
        key = self.pair_spec(scenario, target).launch_key()
        later = [(s, t) for s, t in self.runs[names.index((scenario.name, target)):] if _needs_pair(s, t)]
        group, upcoming = [], []
        for s, t in later:
            spec = self.pair_spec(s, t)
            if not upcoming and spec.launch_key() == key and (spec.warm_up or not group):
                group.append(s)
            elif spec.launch_key() not in [u.launch_key() for u in upcoming]:
                upcoming.append(spec)
        kills = sum(_leaves_decode_dead(s) for s in group[:-1])  # each needs a D after it
        if kills and scenario.launch.warm_up:
            pool.prefetch_decode(min(kills, 2))  # parked once ready; each costs ~1 GB
        for spec in upcoming[: self.PREFETCH_PAIRS]:
            pool.prefetch_pair(spec)

    def execute(self, *, show: bool = True) -> dict:
        """Run everything, tear down, write the reports and (``show``) print them; returns the report dict."""
        try:
            with interrupts_as_keyboard_interrupt():
                for index, (scenario, target) in enumerate(self.runs, 1):
                    self._say(f"[{index}/{len(self.runs)}] {scenario.name} on {target} ({scenario.incident})")
                    self.run_one(scenario, target)
            self.status = "completed"
        except KeyboardInterrupt as exc:
            self.abort(exc)
        except Exception as exc:  # noqa: BLE001
            self.status = "error"
            self.error = f"{type(exc).__name__}: {exc}"
            self.console.print(traceback.format_exc(), markup=False, highlight=False)
        except BaseException as exc:  # SystemExit (rich's answer to a closed stdout pipe), ...: not a finished run
            self.status = "error"
            self.error = f"stopped by {type(exc).__name__}: {exc}"
            raise
        finally:
            report = self.finish()
        if show:
            print_results(report, self.results, make_console())
        if self.error:
            self.console.print(f"[red]{self.error}[/]")
        return report

    def abort(self, exc: BaseException) -> None:
        """Mark the suite interrupted and keep the partial result of the scenario in flight."""
        self.status = "interrupted"
        self.interrupt_signal = "SIGTERM" if "SIGTERM" in str(exc) else "SIGINT"
        self.error = f"interrupted ({self.interrupt_signal})"
        if self._current is not None:
            partial = self._current.result
            partial.verdict, partial.summary = UNKNOWN, "interrupted before this scenario finished"
            partial.notes.append("interrupted; evidence is partial")
            if self._current.load is not None:
                partial.request_ids = self._current.load.request_ids
            if self._current.fault_run is not None:
                partial.faults = self._current.fault_run.records
            self.results.append(partial)

    def finish(self) -> dict:
        """Undo the fault in flight, stop every pair, remove leftover namespaces and cgroups, and
        write ``report.json`` and ``junit.xml`` (SIGINT/SIGTERM held meanwhile); returns the report."""
        if self.status == "running":
            self.status = "completed"
        with signals_deferred(raise_after=False):
            steps = []
            if self._current is not None:
                if self._current.load is not None:
                    steps.append(("release D's slot", self._current.load.release_slot))
                if self._current.fault_run is not None:
                    steps.append(("undo the fault in flight", self._current.fault_run.cleanup))
            steps += [("stop the servers", self.pool.close), ("tear down the SSH hosts", _teardown_hosts),
                      ("remove network namespaces", cleanup_stale_namespaces),
                      ("remove cgroups", cleanup_stale_cgroups)]
            self._say("tearing down (up to 10 s)")
            for what, step in steps:  # each step runs even if one before failed; reports always written
                try:
                    step()
                except Exception as exc:  # noqa: BLE001
                    problem = f"teardown could not {what}: {type(exc).__name__}: {exc}"
                    self.error = f"{self.error}; {problem}" if self.error else problem
                    if self.status == "completed":
                        self.status = "error"
            self._fill_releases()
            report = self.report()
            self._write(report)
        return report

    def _fill_releases(self) -> None:
        """Results no pair ran for (a fault a target cannot take: UNKNOWN by design) and harness errors whose
        release is ``"unknown"`` (a pair start that failed before ``/version`` was read) get the release this
        suite's pairs reported, when they all reported one and the same: every pair of a suite starts from
        the same pair file and interpreters, so that is the release the cell stands for (and its matrix row
        does not split in two)."""
        pairless = {id(r) for r in self._pairless}
        fill = [r for r in self.results if id(r) in pairless
                or (r.vllm_release == "unknown" and r.summary.startswith("harness error"))]
        measured = {r.vllm_release for r in self.results if r.vllm_release != "unknown" and id(r) not in pairless}
        if len(measured) == 1:
            for r in fill:
                r.vllm_release = next(iter(measured))

    def overall(self) -> str:
        """:func:`overall_verdict` of this suite's results and status."""
        return overall_verdict(self.results, self.status)

    def harness_errors(self) -> list[str]:
        """``scenario/target`` of every run that ended in a harness error."""
        return [f"{r.scenario}/{r.target}" for r in self.results if r.summary.startswith("harness error")]

    def report(self) -> dict:
        """The JSON report (valid for interrupted and failed runs too)."""
        matrix: dict = {}
        for r in self.results:
            matrix.setdefault(r.scenario, {})[r.target] = {"verdict": r.verdict, "expected": r.expected, "mode": r.mode,
                                                           "vllm_release": r.vllm_release}
        return {
            "leasekit_version": __version__,
            "status": self.status,
            "verdict": self.overall(),
            "error": self.error,
            "started_at": self.started_at,
            "finished_at": _now_iso(),
            "run_dir": str(self.run_dir),
            "report_path": str(self.run_dir / "report.json"),
            "junit_path": str(self.run_dir / "junit.xml"),
            "planned": [{"scenario": s.name, "target": t} for s, t in self.runs],
            "pair_file": self.pair_file,
            "vllm_releases": sorted({r.vllm_release for r in self.results}),
            "matrix": matrix,
            "matrix_rows": matrix_rows(self.results),
            "harness_errors": self.harness_errors(),
            "results": [r.to_json() for r in self.results],
            "pairs": self.pool.started,
        }

    def _write(self, report: dict) -> None:
        try:
            write_json(self.run_dir / "report.json", report)
            cases = junit_cases(self.results)
            write_junit(self.run_dir / "junit.xml", "leasekit-chaos", cases)
        except OSError as exc:
            self.error = f"{self.error + '; ' if self.error else ''}could not write the reports: {exc}"
            report["error"] = self.error


def _needs_pair(scenario: Scenario, target: str) -> bool:
    from leasekit.chaos.actions import not_injectable
    from leasekit.chaos.execute import target_connectors

    return not any(not_injectable(f, target_connectors(target)) for f in scenario.faults)
