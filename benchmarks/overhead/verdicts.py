"""The goal verdicts of the telemetry-overhead benchmark: per metric and for the whole goal, ``met``,
``not met`` or ``inconclusive``, judged from :func:`.stats.ratios` and the round-to-round spreads of
:func:`.stats.target_summary`. Pure: no I/O, no clock."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .stats import overhead

GOAL_TOLERANCE = 0.02
"""The goal: LeaseKitConnector costs at most 2 % throughput and 2 % p99 latency against stock."""

_EPS = 1e-9  # 1 - 0.98 is 0.020000000000000018: an overhead exactly at the goal meets it
MET, NOT_MET, INCONCLUSIVE = "met", "not met", "inconclusive"

MIN_ROUNDS = 3
"""Rounds needed for a met / not met verdict: the range of two rounds is no noise estimate (measured
here: a stock p99 of 772.0 and 772.7 ms in two rounds, 0.1 % "spread", while leasekit's varied 25 %)."""


@dataclass(frozen=True)
class Verdict:
    """The goal on one metric (or on the whole goal, ``metric == "goal"``).

    Attributes:
        metric: a metric of :data:`.stats.METRICS`, or ``goal``.
        status: :data:`MET`, :data:`NOT_MET` or :data:`INCONCLUSIVE`.
        overhead: the pooled overhead as a fraction (0.03 = 3 % worse than stock); None where there
            is no measurement, and always for the whole goal.
        reason: one human-readable line saying why.
    """

    metric: str
    status: str
    overhead: float | None
    reason: str


def metric_verdict(metric: str, ratio: dict[str, Any], spreads: dict[str, float | None], *,
                   higher_is_better: bool, tolerance: float = GOAL_TOLERANCE, min_rounds: int = MIN_ROUNDS) -> Verdict:
    """Judge "overhead <= tolerance" on one metric.

    ``ratio`` is one entry of :func:`.stats.ratios` (``ratio``, ``per_round``, ``min``, ``max``);
    ``spreads`` maps each target to its round-to-round relative spread of this metric
    (:func:`.stats.relative_spread`; None: fewer than two rounds). The noise is the larger of the
    two: the stock baseline's own spread, or the leasekit pair's (a pair that varies more than the
    difference to resolve cannot show it either). ``tolerance`` is a fraction (0.02 = 2 %).

    - fewer than ``min_rounds`` rounds: inconclusive (no noise estimate);
    - noise > tolerance: inconclusive, unless even the round most favourable to leasekit shows an
      overhead larger than tolerance + noise (a decisive miss: not met);
    - otherwise met when the pooled overhead <= tolerance, else not met.

    A missing or NaN pooled ratio gives ``inconclusive`` ("no measurement").

    Raises:
        KeyError: ``ratio`` lacks one of its keys.
    """
    pooled = ratio["ratio"]
    if pooled is None or math.isnan(pooled):
        return Verdict(metric, INCONCLUSIVE, None, "no measurement")
    oh = overhead(pooled, higher_is_better)
    rounds = ratio["per_round"]
    rng = f"per-round ratios {ratio['min']:.3f}..{ratio['max']:.3f}" if rounds else "no per-round ratio"
    known = {t: v for t, v in spreads.items() if v is not None}
    if len(rounds) < min_rounds or len(known) < len(spreads) or not known:
        return Verdict(metric, INCONCLUSIVE, oh,
                       f"overhead {oh:+.1%} ({rng}), but fewer than {min_rounds} rounds: no noise estimate")
    noisiest = max(known, key=lambda t: known[t])
    noise = known[noisiest]
    where = ("the stock baseline itself varies" if noisiest == "stock"
             else f"the {noisiest} pair varies") + f" {noise:.1%} between rounds"
    others = ", ".join(f"{t} {v:.1%}" for t, v in known.items() if t != noisiest)
    if others:
        where += f" ({others})"
    if noise > tolerance + _EPS:
        best = max(rounds) if higher_is_better else min(rounds)
        best_oh = overhead(best, higher_is_better)
        if best_oh > tolerance + noise + _EPS:
            return Verdict(metric, NOT_MET, oh,
                           f"overhead {oh:+.1%}; even the best round is {best_oh:+.1%}, beyond {tolerance:.0%} + "
                           f"the noise: {where} ({rng})")
        return Verdict(metric, INCONCLUSIVE, oh,
                       f"overhead {oh:+.1%} ({rng}), but {where}, > {tolerance:.0%}: a {tolerance:.0%} "
                       f"difference cannot be resolved here")
    status = MET if oh <= tolerance + _EPS else NOT_MET
    sign = "<=" if status == MET else ">"
    return Verdict(metric, status, oh, f"overhead {oh:+.1%} {sign} {tolerance:.0%} ({rng}; {where})")


def goal_verdict(verdicts: Sequence[Verdict], failed: dict[str, int]) -> Verdict:
    """The whole goal (throughput and p99): not met if any metric is not met or a leasekit request
    failed; else inconclusive if any metric is inconclusive or a stock request failed; else met.

    ``verdicts`` are the deciding metrics' :func:`metric_verdict` results; ``failed`` maps a target
    to its failed request count (a missing target counts as 0). Returns a :class:`Verdict` with
    ``metric == "goal"`` and ``overhead`` None. Never raises.
    """
    if failed.get("leasekit"):
        return Verdict("goal", NOT_MET, None, f"{failed['leasekit']} request(s) failed on the leasekit pair")
    bad = [v for v in verdicts if v.status == NOT_MET]
    if bad:
        return Verdict("goal", NOT_MET, None, "; ".join(f"{v.metric}: {v.reason}" for v in bad))
    if failed.get("stock"):
        return Verdict("goal", INCONCLUSIVE, None, f"{failed['stock']} request(s) failed on the stock pair")
    unsure = [v for v in verdicts if v.status == INCONCLUSIVE]
    if unsure:
        return Verdict("goal", INCONCLUSIVE, None, "; ".join(f"{v.metric}: {v.reason}" for v in unsure))
    return Verdict("goal", MET, None, "throughput and p99 latency overhead within the goal")
