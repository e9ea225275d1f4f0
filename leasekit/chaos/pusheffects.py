"""Evidence that a push-mode abort happened where the scenario meant it: after D registered the request (sent P its
``PUSH_REG``) and before P's WRITE of its KV blocks landed. Without it, an abort storm whose cancels came before D
registered (a slow D) would pass for the mid-push case while exercising only the queued one."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from leasekit.chaos.actions import Effect
from leasekit.chaos.evidence import ClockMismatch
from leasekit.chaos.schema import StallFault
from leasekit.telemetry.lease_timeline import LeaseTimeline

EFFECT_NAME = "requests aborted by D after it registered them, before their WRITE landed"


def aborted_mid_push(scenario, load, leases: Iterable[LeaseTimeline],
                     to_p_clock: Callable[[float, float], float]) -> list[Effect]:
    """For a push-mode scenario that cancels requests (``abort_storm``) while P's writer is stalled (``push_writer``):
    one :class:`Effect`, in effect when every cancelled request's lease was released by its WRITE (so D had
    registered it: D never registers a request it aborted) and P saw that WRITE finish after the request's client
    gave up (so D aborted it while the WRITE was still to come). Empty for every other scenario.

    ``scenario``: the :class:`leasekit.chaos.scenario.Scenario`; ``load``: its
    :class:`leasekit.chaos.workload.QueuedDecodeLoad`; ``leases``: P's lease timelines of the run (seconds on P's
    evidence clock); ``to_p_clock(monotonic_s, wall_s)``: a runner instant on that clock (raises
    :class:`~leasekit.chaos.evidence.ClockMismatch` when it cannot). Never raises.
    """
    if load is None or not any(isinstance(f, StallFault) and f.method == "push_writer" for f in scenario.faults):
        return []
    cancelled = [i for i, intent in load.intent.items() if intent == "cancel"]
    if not cancelled:
        return []
    by_id: dict[str, list[LeaseTimeline]] = {}
    for lease in leases:
        by_id.setdefault(lease.request_id, []).append(lease)
    mid, why = 0, []
    for index in cancelled:
        rid, result = load.request_id(index), load.decodes.get(index)
        released = [lease for lease in by_id.get(rid or "", []) if lease.outcome == "released"]
        if result is None or result.ok:
            why.append(f"request {index} was {'answered' if result is not None else 'never routed'}")
        elif not released:
            why.append(f"request {index}: no WRITE released its lease (D never registered it)")
        else:
            try:
                gave_up = to_p_clock(result.done_monotonic_s, result.done_wall_s)
            except ClockMismatch as exc:
                return [Effect(EFFECT_NAME, False, f"cannot place the cancels on P's clock: {exc}")]
            after = max(lease.end_s for lease in released) - gave_up
            if after > 0:
                mid += 1
            else:
                why.append(f"request {index}: its WRITE finished {-after:.3f} s before its client gave up")
    evidence = f"{mid} of {len(cancelled)} cancelled requests had their WRITE finish on P after their client gave up"
    return [Effect(EFFECT_NAME, mid == len(cancelled), evidence + ("; " + "; ".join(why) if why else ""))]
