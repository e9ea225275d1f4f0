"""The lease protocol as pure code (no I/O, times passed in): the reference model everything else
is checked against.

- :mod:`~leasekit.lease.config`: ``L``/``H``/``E`` exactly as vLLM derives them, config parsing, lint.
- :mod:`~leasekit.lease.bounds`: the reclaim bound, safe stall and heartbeat loss budget.
- :mod:`~leasekit.lease.table`: P's lease table (grant, renew, complete, release, abort, reap).
- :mod:`~leasekit.lease.tracker`: D's heartbeat bookkeeping.
- :mod:`~leasekit.lease.topology`: which P ranks a D rank talks to; consumers per P rank.
- :mod:`~leasekit.lease.codec`: notification bytes, byte-identical to vLLM's; decoding never raises.
- :mod:`~leasekit.lease.clock`: clock-offset estimation and the turn-2 expiry check.
"""

from leasekit.lease.bounds import loss_budget, reclaim_bound, reclaim_deadline, safe_stall_s
from leasekit.lease.clock import ClockOffsetEstimator, turn2_read_expired
from leasekit.lease.codec import Completion, DecodeError, Heartbeat, decode_notification, encode_completion, encode_heartbeat
from leasekit.lease.config import (
    LeaseConfig,
    LeaseConfigError,
    LeaseTiming,
    LintFinding,
    lint_kv_transfer_config,
    lint_timing,
)
from leasekit.lease.table import Lease, LeaseEnd, Outcome, PLeaseTable
from leasekit.lease.topology import consumers_per_prefill_rank, prefill_ranks_for
from leasekit.lease.tracker import DHeartbeatTracker

__all__ = [
    "ClockOffsetEstimator",
    "Completion",
    "DHeartbeatTracker",
    "DecodeError",
    "Heartbeat",
    "Lease",
    "LeaseConfig",
    "LeaseConfigError",
    "LeaseEnd",
    "LeaseTiming",
    "LintFinding",
    "Outcome",
    "PLeaseTable",
    "consumers_per_prefill_rank",
    "decode_notification",
    "encode_completion",
    "encode_heartbeat",
    "lint_kv_transfer_config",
    "lint_timing",
    "loss_budget",
    "prefill_ranks_for",
    "reclaim_bound",
    "reclaim_deadline",
    "safe_stall_s",
    "turn2_read_expired",
]
