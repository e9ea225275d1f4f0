"""The lease protocol as pure code: timing derivation, bounds (no I/O, clock injected)."""

from leasekit.lease.bounds import (
    loss_budget,
    reclaim_bound,
    reclaim_deadline,
    safe_stall_s,
)
from leasekit.lease.config import LeaseConfigError, LeaseTiming, lint_timing

__all__ = [
    "LeaseConfigError",
    "LeaseTiming",
    "lint_timing",
    "loss_budget",
    "reclaim_bound",
    "reclaim_deadline",
    "safe_stall_s",
]
