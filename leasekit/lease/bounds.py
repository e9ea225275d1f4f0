"""The bound formulas every check is held to (docs/lease-model.md, "Bounds"). All values are seconds.

- Reclaim after D goes silent: ``reap_time <= max(grant + L, last_delivered_hb + E) + tick``.
- No false expiry while D is healthy: a D stall shorter than ``E - H`` never expires a lease.
- Loss budget: up to ``k < (E - H) / H`` consecutive lost heartbeats are survived.

``tick`` is P's step period: P drains notifications and reaps once per engine step, so an expired
lease is reclaimed at the first step at or after its deadline (vllm 0.32.0
``base_worker.py: get_transfer_results -> _reap_expired_send_leases``).
"""

from __future__ import annotations

import math

from leasekit.lease.config import LeaseConfigError, LeaseTiming


def _finite(name: str, value: float, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum} s, got {value!r}")
    return float(value)


def reclaim_deadline(timing: LeaseTiming, grant_s: float, last_heartbeat_s: float | None) -> float:
    """The instant (seconds, on P's monotonic clock) from which P may reclaim the lease.

    ``max(grant + L, last_delivered_hb + E)``; with no delivered heartbeat, ``grant + L``.

    Args:
        timing: the lease timing in force on P.
        grant_s: when P granted the lease (P's clock, seconds).
        last_heartbeat_s: when P handled the last heartbeat naming the lease, or None.

    Raises:
        ValueError: a time is not finite, or the heartbeat precedes the grant.
    """
    grant = _finite("grant_s", grant_s)
    deadline = grant + timing.lease_duration_s
    if last_heartbeat_s is not None:
        hb = _finite("last_heartbeat_s", last_heartbeat_s)
        if hb < grant:
            raise ValueError(
                f"last_heartbeat_s ({hb:.6f}) precedes grant_s ({grant:.6f}): a heartbeat can only "
                "extend a lease P already granted; are both on P's clock?"
            )
        deadline = max(deadline, hb + timing.extension_s)
    return deadline


def reclaim_bound(
    timing: LeaseTiming, grant_s: float, last_heartbeat_s: float | None, tick_s: float
) -> float:
    """The latest instant (seconds, P's clock) by which P must have reclaimed a silent D's lease.

    ``reclaim_deadline(...) + tick_s``.

    Raises:
        ValueError: as :func:`reclaim_deadline`, or ``tick_s`` negative or not finite.
    """
    tick = _finite("tick_s", tick_s, minimum=0.0)
    return reclaim_deadline(timing, grant_s, last_heartbeat_s) + tick


def safe_stall_s(timing: LeaseTiming) -> float:
    """The longest D stall (seconds) that can never expire a lease: ``E - H``, floored at 0.

    Worst case: the stall begins just before the next heartbeat was due, ``H`` after the last one
    delivered; the lease's deadline is ``last + E``, so a stall of ``E - H`` or longer may expire it
    (a stall that begins right after a heartbeat survives up to ``E``). Returns 0.0 when ``E <= H``
    (no stall is safe: lint that config).
    """
    return float(max(0.0, timing.extension_s - timing.heartbeat_interval_s))


def silence_may_expire(silence_s: float, timing: LeaseTiming) -> bool:
    """Whether D, having sent no heartbeat naming a lease for ``silence_s`` seconds (its longest such interval
    since it began heartbeating the request, the one still open included), must assume P may have reclaimed it.

    P reclaims at ``max(grant + L, last delivered heartbeat + E)`` (vllm ``nixl`` ``_reap_expired``), so while
    every silence on D's side is shorter than ``E`` less the spread of delivery delays, P's silences are shorter
    than ``E`` and the lease lives. The threshold allows that spread ``H / 2``, or less where the loss budget's
    silence ``(budget + 1) * H`` (:func:`loss_budget`, which never expires a lease) comes closer to ``E``: then it is
    halfway between the two (at L = 6: 3.5 s; L = 20: 12.5 s; L = 30: 17.5 s). True when
    ``silence_s >= max(E - H / 2, ((budget + 1) * H + E) / 2)`` (``E`` itself when ``H`` is 0). It can be true
    of a lease that still lives (``grant + L`` covers an early silence): acting on it is safe, never wrong.

    Raises:
        ValueError: ``silence_s`` negative or not finite.
    """
    silence = _finite("silence_s", silence_s, minimum=0.0)
    H, E = timing.heartbeat_interval_s, timing.extension_s
    if H <= 0 or E <= H:
        return silence >= E
    budget_silence = (loss_budget(timing) + 1) * H
    return silence >= max(E - H / 2, (budget_silence + E) / 2)


def loss_budget(timing: LeaseTiming) -> int:
    """How many consecutive heartbeats can be lost without a (healthy) lease expiring.

    The largest integer ``k >= 0`` with ``k < (E - H) / H``. For the default ``L = 30``
    (``H = 5``, ``E = 20``) this is 2; losing 3 puts the next heartbeat exactly on the
    expiry instant (the tie of incident class K08: a stall of exactly the budget).

    Raises:
        LeaseConfigError: ``H == 0`` (``L < 6``: heartbeats go out every step, so a budget counted in
            heartbeats is undefined), ``E <= H`` (even with no loss a lease can expire), or ``H`` or ``E``
            not finite (an ``L`` so large that ``L * 2`` overflows).
    """
    H, E = timing.heartbeat_interval_s, timing.extension_s
    if H <= 0:
        raise LeaseConfigError(
            f"heartbeat interval is {H} s (kv_lease_duration={timing.lease_duration_s} < 6): "
            "D heartbeats every step, so a loss budget in heartbeats is undefined; "
            "fix: kv_lease_duration >= 6"
        )
    if E <= H:
        raise LeaseConfigError(
            f"extension E={E} s <= heartbeat interval H={H} s: a lease can expire between two "
            "delivered heartbeats; fix: kv_lease_duration >= 6"
        )
    ratio = (E - H) / H
    if not math.isfinite(ratio):
        raise LeaseConfigError(f"kv_lease_duration={timing.lease_duration_s!r} gives H={H} s, E={E} s: not finite, "
                               "so no loss budget; fix: kv_lease_duration in (0, 3600]")
    return max(0, math.ceil(ratio) - 1)


RECLAIM_LAG_FLOOR_S = 0.5
"""Floor of the reclaim-lag threshold ``max(H, 0.5 s)``: the tick allowance the chaos catalog
holds P's reaper to (``chaos/kill-decode.toml``: ``tick_s = 0.5``); it keeps the threshold above
0 when ``L < 6`` makes ``H = 0``."""
