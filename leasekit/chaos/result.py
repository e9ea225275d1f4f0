"""The outcome of one scenario on one target: verdict, expectation, checks, took-effect evidence,
the faults as executed; what the suite reports (terminal, JSON, JUnit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from leasekit.chaos import FAIL
from leasekit.chaos.actions import Effect
from leasekit.chaos.checks import CheckResult


@dataclass
class ScenarioResult:
    """The outcome of one scenario on one target.

    ``mode`` and ``vllm_release`` are the conformance matrix's other axes: the transfer mode (``pull`` or
    ``push``) and the vLLM release the pair reported on ``GET /version`` (``"0.32.0"``; a mixed pair
    ``"P 0.33.0 / D 0.32.0"``; ``"unknown"`` when unreadable; see :mod:`leasekit.cluster.vllmrelease`).
    ``pair_file``: the pair file of the run (a matrix row key when several ran; None without ``--pair``).
    """

    scenario: str
    target: str
    verdict: str
    expected: str
    summary: str
    incident: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    steady_state: CheckResult | None = None
    effects: list[Effect] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    evidence_source: str | None = None
    plot: str | None = None
    duration_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    known_defect: str | None = None
    expected_failing: list[str] = field(default_factory=list)
    mode: str = "pull"  # NIXL transfer mode of the pair: pull, or push (vLLM's NixlPushConnector)
    vllm_release: str = "unknown"  # what the pair's GET /version reported (leasekit.cluster.vllmrelease)
    pair_file: str | None = None  # the --pair file this ran on (None: the CPU default pair)

    @property
    def as_expected(self) -> bool:
        """The verdict is the expected one; for an expected FAIL, exactly the expected checks
        failed (with the steady state holding), so another regression is never "as expected"."""
        if self.verdict != self.expected:
            return False
        if self.verdict != FAIL:
            return True
        failed = {c.name for c in self.checks if c.verdict == FAIL}
        steady_ok = self.steady_state is None or self.steady_state.verdict != FAIL
        return steady_ok and failed == {name.replace("_", "-") for name in self.expected_failing}

    def to_json(self) -> dict:
        """The result as ``report.json`` holds it (times in seconds)."""
        return {
            "scenario": self.scenario, "target": self.target, "mode": self.mode, "vllm_release": self.vllm_release,
            "pair_file": self.pair_file, "incident": self.incident,
            "verdict": self.verdict, "expected": self.expected, "as_expected": self.as_expected,
            "summary": self.summary, "known_defect": self.known_defect, "expected_failing_checks": self.expected_failing,
            "steady_state": None if self.steady_state is None else self.steady_state.to_json(),
            "checks": [c.to_json() for c in self.checks],
            "effects": [e.to_json() for e in self.effects],
            "faults": self.faults, "request_ids": self.request_ids,
            "evidence_source": self.evidence_source, "plot": self.plot,
            "duration_s": self.duration_s, "notes": self.notes,
        }
