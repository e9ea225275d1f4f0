"""Planted defects: each must be caught by the property tests (tests/sim/test_properties.py).

They are the classic ways to get the lease wrong, kept as tests so the suite proves it can fail.
"""

from leasekit.lease.table import CompletionResult, LeaseEnd, Outcome, PLeaseTable, StepResult


class ReapFirstTable(PLeaseTable):
    """Reaps before draining the step's notifications: a heartbeat queued behind a slow step
    arrives too late to save its lease (CASES.md K09)."""

    def step(self, now_s, notifications=()):
        reaped = self.reap(now_s)
        result: StepResult = super().step(now_s, notifications)
        result.ended[:0] = reaped
        return result


class HeadOnlyReapTable(PLeaseTable):
    """Reaps in grant order and stops at the first live lease: an expired lease behind a
    heartbeated one is never reclaimed (CASES.md K05)."""

    def reap(self, now_s):
        ended = []
        for lease in list(self._leases.values()):
            if lease.deadline_s > now_s:
                break
            ended.append(self._end(lease, Outcome.EXPIRED, now_s))
        return ended


class NonIdempotentReleaseTable(PLeaseTable):
    """Treats a completion for an ended lease as a release again: the blocks are freed twice
    (CASES.md K04)."""

    def completion(self, req_id, expected_consumers, now_s, sender=None):
        outcome = self.ended_outcome(req_id)
        if req_id not in self._leases and outcome is not None:
            from leasekit.lease.table import Lease

            ghost = Lease(req_id, now_s, now_s)
            return CompletionResult("released", LeaseEnd(req_id, Outcome.RELEASED, now_s, ghost))
        return super().completion(req_id, expected_consumers, now_s, sender)
