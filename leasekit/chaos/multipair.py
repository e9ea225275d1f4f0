"""One chaos run over several pair files (``leasekit chaos run --all --pair a.toml --pair b.toml``): the
same scenarios against each deployment in turn, typically two vLLM releases (each pair file's ``python``
points at an interpreter with one release), and one conformance matrix over them all.

Each pair file runs as an ordinary :class:`leasekit.chaos.suite.Suite` in its own sub-directory of the run
directory, ``<run dir>/<NN>-<file stem>/`` (its own ``report.json``, ``junit.xml``, ``scenarios/``,
``pairs/``: nothing is overwritten), one after the other (never two deployments' pairs at once). The run
directory then holds the combined ``report.json`` and ``junit.xml``, and the terminal gets one matrix:
rows keyed pair file x scenario x transfer mode x vLLM release (the release each pair reported,
:mod:`leasekit.cluster.vllmrelease`), a column per target. The matrix's ``pair file`` column and the
JUnit case names show each file's sub-directory name (``01-cpu-local``), unique even when two pair files
share a base name.

The combined ``report.json`` has ``status``, ``verdict``, ``error``, ``pair_files`` (per file: its
sub-directory, report, status, verdict, releases), ``vllm_releases``, ``matrix_rows``, ``harness_errors``
(``"<pair file>: <scenario>/<target>"``), every ``results`` entry (each with ``pair_file`` and
``vllm_release``) and ``pairs``; no ``matrix`` (scenario x target cannot hold one cell per pair file:
read ``matrix_rows``, or each sub-report's ``matrix``). Ctrl-C or SIGTERM ends the suite in flight as a
single run would (its teardown, its reports) and skips the pair files after it; the combined reports are
still written, ``"status": "interrupted"``.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from leasekit import __version__
from leasekit.chaos.junit import write_junit
from leasekit.chaos.report import junit_cases, make_console, matrix_rows, print_results, write_json
from leasekit.chaos.suite import Suite, interrupts_as_keyboard_interrupt, overall_verdict

_STATUS_RANK = {"completed": 0, "error": 1, "interrupted": 2}


def pair_run_dir(run_dir: str | Path, index: int, pair_file: str) -> Path:
    """The sub-directory of pair file number ``index`` (from 1): ``<run dir>/01-<file stem>`` (characters
    other than letters, digits, ``.``, ``_`` and ``-`` become ``_``)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(pair_file).stem) or "pair"
    return Path(run_dir) / f"{index:02d}-{stem}"


class PairFileRuns:
    """Runs one suite per pair file and writes the combined reports.

    Args:
        entries: ``(pair file path as given, its PairFile, its planned runs)`` per pair file, in run order
            (the runs as :func:`leasekit.chaos.suite.plan` orders them, with that file's lease duration).
        run_dir: the run directory (created by the suites).
        start_timeout_s: seconds each server may take to start.
        suite_factory: builds each suite (``Suite``'s signature); tests pass a stand-in.
    """

    def __init__(self, entries: list[tuple[str, object, list]], run_dir: str | Path, *, start_timeout_s: float = 300.0,
                 suite_factory=Suite):
        self.entries = entries
        self.run_dir = Path(run_dir).resolve()
        self.start_timeout_s = start_timeout_s
        self.suite_factory = suite_factory
        self.suites: list = []
        self.reports: list[dict] = []
        self.interrupt_signal: str | None = None
        self.started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")

    def execute(self, *, show: bool = True) -> dict:
        """Run each pair file's suite in turn, write ``report.json`` and ``junit.xml`` into the run directory,
        print every result and the one matrix (``show``); returns the combined report."""
        try:
            with interrupts_as_keyboard_interrupt():
                for index, (pair_file, deployment, runs) in enumerate(self.entries, 1):
                    suite = self.suite_factory(runs, pair_run_dir(self.run_dir, index, pair_file),
                                               start_timeout_s=self.start_timeout_s, deployment=deployment,
                                               pair_file=pair_file)
                    self.suites.append(suite)
                    suite.console.log(f"pair file {index}/{len(self.entries)}: {pair_file} -> {suite.run_dir}")
                    self.reports.append(suite.execute(show=False))
                    if suite.status == "interrupted":
                        self.interrupt_signal = suite.interrupt_signal
                        break
        except KeyboardInterrupt as exc:  # between two suites: nothing of ours is running
            self.interrupt_signal = "SIGTERM" if "SIGTERM" in str(exc) else "SIGINT"
        report = self.report()
        write_json(self.run_dir / "report.json", report)
        write_junit(self.run_dir / "junit.xml", "leasekit-chaos", junit_cases(self.results(), labels=self.labels()))
        if show:
            print_results(report, self.results(), make_console(), labels=self.labels())
        return report

    def labels(self) -> dict[str, str]:
        """Pair file as given -> the name of its sub-directory (``01-cpu-local``): unique in the run, unlike
        the file's base name; the matrix's ``pair file`` column and the JUnit names use it."""
        return {pair_file: pair_run_dir(self.run_dir, index, pair_file).name
                for index, (pair_file, _, _) in enumerate(self.entries, 1)}

    def results(self) -> list:
        """Every suite's results, in run order."""
        return [r for suite in self.suites for r in suite.results]

    def status(self) -> str:
        """``interrupted`` when a signal ended the run, else the worst suite status (``error`` over
        ``completed``); ``interrupted`` too when a pair file never ran."""
        if self.interrupt_signal is not None or len(self.suites) < len(self.entries):
            return "interrupted"
        return max((suite.status for suite in self.suites), key=lambda s: _STATUS_RANK.get(s, 1), default="completed")

    def report(self) -> dict:
        """The combined JSON report (see the module docstring); valid for interrupted runs too."""
        results, status = self.results(), self.status()
        errors = [f"{s.pair_file}: {s.error}" for s in self.suites if s.error]
        if self.interrupt_signal and not any("interrupted" in e for e in errors):
            errors.append(f"interrupted ({self.interrupt_signal})")
        files = []
        for index, (pair_file, _, _) in enumerate(self.entries, 1):
            sub = self.reports[index - 1] if index <= len(self.reports) else None
            files.append({"pair_file": pair_file, "run_dir": str(pair_run_dir(self.run_dir, index, pair_file)),
                          "report_path": None if sub is None else sub["report_path"],
                          "status": "not run" if sub is None else sub["status"],
                          "verdict": None if sub is None else sub["verdict"],
                          "vllm_releases": [] if sub is None else sub["vllm_releases"]})
        return {
            "leasekit_version": __version__,
            "status": status,
            "verdict": overall_verdict(results, status),
            "error": "; ".join(errors) or None,
            "started_at": self.started_at,
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
            "run_dir": str(self.run_dir),
            "report_path": str(self.run_dir / "report.json"),
            "junit_path": str(self.run_dir / "junit.xml"),
            "planned": [{"scenario": s.name, "target": t, "pair_file": f} for f, _, runs in self.entries for s, t in runs],
            "pair_files": files,
            "vllm_releases": sorted({r.vllm_release for r in results}),
            "matrix_rows": matrix_rows(results),
            "harness_errors": [f"{s.pair_file}: {e}" for s in self.suites for e in s.harness_errors()],
            "results": [r.to_json() for r in results],
            "pairs": [p for suite in self.suites for p in suite.pool.started],
        }
