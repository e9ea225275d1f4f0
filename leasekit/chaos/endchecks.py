"""End-of-run chaos checks: what must hold once traffic stops (conservation on P and on D) and after the faults
(liveness). Each returns a :class:`leasekit.chaos.checks.CheckResult` with PASS, FAIL or UNKNOWN and its evidence.
Invariants 7 and 8 of docs/lease-model.md; the D-side leak is the one reported upstream for aborted pushes (https://github.com/vllm-project/vllm/issues/46283)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.checks import CheckResult


def check_conservation(kv_usage_after: float | None, open_leases: Iterable[str], *, waited_s: float) -> CheckResult:
    """Invariant 8: when traffic stops, P's pinned KV blocks return to zero.

    ``kv_usage_after``: P's ``vllm:kv_cache_usage_perc`` gauge after the wait (None: unreadable);
    ``open_leases``: workload requests with no recorded lease end.
    """
    open_leases = list(open_leases)
    problems = []
    if kv_usage_after is None:
        return CheckResult("conservation", UNKNOWN, "P's /metrics was unreadable", details={"open_leases": open_leases})
    if kv_usage_after > 0:
        problems.append(f"P's KV cache still {kv_usage_after * 100:.2f}% used {waited_s:.0f} s after traffic stopped")
    if open_leases:
        problems.append(f"{len(open_leases)} lease(s) never ended")
    verdict = FAIL if problems else PASS
    return CheckResult("conservation", verdict, "; ".join(problems) or "every lease ended; P's KV cache back to 0",
                       details={"kv_cache_usage_perc": kv_usage_after, "open_leases": open_leases, "waited_s": waited_s})


def check_decode_conservation(kv_usage_after: float | None, *, waited_s: float, decode_killed: bool = False) -> CheckResult:
    """No KV leak on D: when traffic stops, D's KV blocks return to zero, aborted and timed-out requests
    included (the push-mode leak reported upstream, https://github.com/vllm-project/vllm/issues/46283: D kept the blocks an aborted push had registered).

    ``kv_usage_after``: D's ``vllm:kv_cache_usage_perc`` gauge (a fraction, 0..1) after waiting up to
    ``waited_s`` seconds (None: unreadable); ``decode_killed``: the fault killed D, so nothing is left to read.
    """
    details = {"kv_cache_usage_perc": kv_usage_after, "waited_s": waited_s}
    if decode_killed:
        return CheckResult("decode-conservation", UNKNOWN, "D was killed: its KV cache is gone", details=details)
    if kv_usage_after is None:
        return CheckResult("decode-conservation", UNKNOWN, "D's /metrics was unreadable", details=details)
    if kv_usage_after > 0:
        return CheckResult("decode-conservation", FAIL, f"D's KV cache still {kv_usage_after * 100:.2f}% used "
                           f"{waited_s:.0f} s after traffic stopped: KV blocks leaked on D", details=details)
    return CheckResult("decode-conservation", PASS, "D's KV cache back to 0", details=details)


def check_liveness(unanswered: Iterable[str], decode_healthy: bool | None, fresh_request_ok: bool | None,
                   answers: Mapping[str, str] | None = None) -> CheckResult:
    """Invariant 7: faults never leave a request waiting forever; D and P keep serving.

    ``unanswered``: requests with no HTTP answer at all; ``fresh_request_ok``: a new routed request
    after the fault was served (None: not attempted); ``answers``: request id -> what each got
    (for the evidence).
    """
    unanswered = list(unanswered)
    problems = []
    if unanswered:
        problems.append(f"{len(unanswered)} request(s) never answered")
    if decode_healthy is False:
        problems.append("D unhealthy after the fault")
    if fresh_request_ok is False:
        problems.append("a fresh request after the fault was not served")
    verdict = FAIL if problems else PASS
    return CheckResult("liveness", verdict, "; ".join(problems) or "every request answered; a fresh request served",
                       details={"unanswered": unanswered, "decode_healthy": decode_healthy,
                                "fresh_request_ok": fresh_request_ok, "answers": dict(answers or {})})


def liveness_after(load: Any, pair: Any, *, decode_killed: bool) -> CheckResult:
    """:func:`check_liveness` of a finished run: ``load`` a :class:`leasekit.chaos.workload.QueuedDecodeLoad`,
    ``pair`` the :class:`leasekit.cluster.pair.PDPair` it ran on. A request meant to reach D is unanswered when
    its decode never returned, or when its client gave up (``answer_within_s``: an httpx timeout, no HTTP answer); unless D
    was killed, D's health is read and one fresh routed request is sent (it blocks until answered)."""
    unanswered = [load.request_id(i) for i, x in load.intent.items() if x != "never" and (
        i not in load.decodes
        or (x == "decode" and load.answer_within_s is not None and load.decodes[i].status == 0
            and "Timeout" in (load.decodes[i].error or "")))]
    healthy = pair.decode.healthy() if not decode_killed else None
    fresh = None
    if not decode_killed and pair.router is not None:
        fresh = pair.router.generate(pair.prompt(), 2).decode
        fresh = bool(fresh and fresh.ok)
    answers = {load.request_id(i): f"HTTP {d.status} after {d.latency_s:.1f} s" + (f" ({(d.error or '')[:80]})" if not d.ok else "")
               for i, d in load.decodes.items()}
    return check_liveness(unanswered, healthy, fresh, answers)


LATE_WRITE_METRIC = "vllm:nixl_num_notifications_after_expiry"
"""D's count of transfer notifications for requests it no longer waits on (vllm 0.32.0 ``nixl/stats.py``; in push
mode ``push_worker.py`` counts a WRITE notification D has no receive for, and LeaseKit's D counts it the same way):
a WRITE that finished into blocks D may already have given to another request."""


def late_writes(metrics: Mapping[str, float]) -> float | None:
    """D's :data:`LATE_WRITE_METRIC` from a scrape (``{sample name: value}``; the counter's ``_total`` sample or
    the bare name), None if D does not export it."""
    for name in (LATE_WRITE_METRIC + "_total", LATE_WRITE_METRIC):
        if name in metrics:
            return float(metrics[name])
    return None


def late_writes_on(server: Any) -> float | None:
    """:func:`late_writes` from ``server``'s ``/metrics`` (a server with ``metrics()``); None when it does not answer."""
    try:
        return late_writes(server.metrics())
    except httpx.HTTPError:
        return None


def check_no_late_write(before: float | None, after: float | None, *, decode_killed: bool = False) -> CheckResult:
    """No WRITE lands in a reused D slot: D counted no transfer notification for a request it no longer waited on
    during the run (:data:`LATE_WRITE_METRIC`, read before the fault run and after the end-of-run waits).

    ``before`` / ``after``: the counter's values (None: unreadable or not exported); ``decode_killed``: the fault
    killed D, so its counter restarted. UNKNOWN when either reading is missing or D was killed.
    """
    details = {"metric": LATE_WRITE_METRIC, "before": before, "after": after}
    if decode_killed:
        return CheckResult("no-late-write", UNKNOWN, "D was killed: its counters restarted", details=details)
    if before is None or after is None:
        return CheckResult("no-late-write", UNKNOWN, f"D's {LATE_WRITE_METRIC} was not readable "
                           f"{'before the fault run' if before is None else 'after it'}", details=details)
    if after > before:
        return CheckResult("no-late-write", FAIL, f"{after - before:g} WRITE(s) finished on D for requests it no longer "
                           "waited on: their KV blocks may have been given to other requests", details=details)
    return CheckResult("no-late-write", PASS, "no WRITE finished on D after it stopped waiting for it", details=details)
