"""Lease timing derived from ``kv_lease_duration`` exactly as vLLM derives it.

Source: vllm 0.32.0 ``distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``
(``self._heartbeat_interval = self._kv_lease_duration // 6``) and ``base_worker.py``
(``self._lease_extension = kv_lease_duration * 2 // 3``). Python floor division is kept as is:
an int ``L`` gives int ``H`` and ``E``; a float ``L`` gives float ``H`` and ``E`` (``7.5 // 6 == 1.0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_LEASE_DURATION_S = 30
"""vLLM's default ``kv_lease_duration`` in seconds (``get_from_extra_config(..., 30)``)."""


class LeaseConfigError(ValueError):
    """A lease setting is outside the range the mechanism can work with.

    The message names the field, the value, the allowed range and the fix.
    """


def _check_duration(lease_duration_s: object) -> float | int:
    if isinstance(lease_duration_s, bool) or not isinstance(lease_duration_s, (int, float)):
        raise LeaseConfigError(
            f"kv_lease_duration must be a number of seconds, got {lease_duration_s!r} "
            f"({type(lease_duration_s).__name__}); fix: pass e.g. 30"
        )
    if not math.isfinite(lease_duration_s) or lease_duration_s <= 0:
        raise LeaseConfigError(
            f"kv_lease_duration must be a finite number of seconds > 0, got {lease_duration_s!r}; "
            "fix: pass e.g. 30 (vLLM's default)"
        )
    return lease_duration_s


def lint_timing(timing: "LeaseTiming") -> list[str]:
    """Findings for the config edges of DESIGN.md ("Bounds"), each with its fix; [] when clean.

    - ``H == 0`` (``L < 6``): D heartbeats every engine step.
    - ``E == 0`` (``L < 2``): heartbeats extend nothing; every lease expires at ``grant + L``.
    - ``0 < E <= H``: a lease can expire between two delivered heartbeats.
    """
    L, H, E = timing.lease_duration_s, timing.heartbeat_interval_s, timing.extension_s
    findings = []
    if E <= 0:
        findings.append(
            f"kv_lease_duration={L} < 2 gives extension E={E}: heartbeats do nothing and every lease "
            "expires at grant + L even while D is healthy; fix: kv_lease_duration >= 6"
        )
    elif E <= H:
        findings.append(f"extension E={E} <= heartbeat interval H={H}: leases can expire between heartbeats; fix: kv_lease_duration >= 6")
    if H <= 0:
        findings.append(
            f"kv_lease_duration={L} < 6 gives heartbeat interval H={H}: D sends a heartbeat batch every "
            "engine step; fix: kv_lease_duration >= 6"
        )
    return findings


@dataclass(frozen=True)
class LeaseTiming:
    """The three lease numbers, all in seconds.

    Attributes:
        lease_duration_s: ``L``, the lease P grants at the end of a prefill (``kv_lease_duration``).
        heartbeat_interval_s: ``H = L // 6``, how often D sends one heartbeat batch per P engine.
        extension_s: ``E = L * 2 // 3``; each delivered heartbeat sets
            ``expiry = max(expiry, now + E)`` on P.

    Build it with :meth:`from_lease_duration`; the constructor does not re-derive ``H`` and ``E``.
    """

    lease_duration_s: float
    heartbeat_interval_s: float
    extension_s: float

    @classmethod
    def from_lease_duration(cls, lease_duration_s: float) -> "LeaseTiming":
        """Derive ``H`` and ``E`` from ``L`` (seconds) with vLLM's integer/float floor division.

        Raises:
            LeaseConfigError: ``L`` is not a finite number > 0 (bool and str are refused).
        """
        L = _check_duration(lease_duration_s)
        return cls(lease_duration_s=L, heartbeat_interval_s=L // 6, extension_s=L * 2 // 3)
