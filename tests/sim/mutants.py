"""Planted defects: each must be caught by the property tests (tests/sim/test_properties.py for pull
mode, tests/sim/test_push_properties.py for the push-mode ones at the end).

They are the classic ways to get the lease wrong, kept as tests so the suite proves it can fail.
"""

from leasekit.lease.pushreg import PushRegGuard
from leasekit.lease.table import CompletionResult, LeaseEnd, Outcome, PLeaseTable, StepResult
from leasekit.sim.push import D_HOST, MAX_REG_BYTES, PushP


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


# -- push mode (leasekit.sim.push) ----------------------------------------------------------------------


class ReleaseOnCompletionPush(PushP):
    """Frees a push lease on D's read completion instead of on its own WRITE (stock vllm 0.32.0's push P still
    counts read completions; vllm 0.33.0 and LeaseKit free only on the WRITE)."""

    def table_notifications(self, decoded):
        return list(decoded)

    def observe(self, write, t, local):
        write.p_view = "ignored"


class _RepeatAcceptingGuard(PushRegGuard):
    def filter(self, regs, now):
        self._matched.clear()  # forgets which leases already had their registration
        return super().filter(regs, now)


class RepeatRegistrationPush(PushP):
    """Acts on every registration for a live lease, repeats included (a second D rank's, a duplicate): two
    WRITEs, the second reading blocks the first one's release freed."""

    def make_guard(self, rank, hold_s):
        return _RepeatAcceptingGuard(live=lambda req_id: self.live(rank, req_id), allowed=lambda host: host == D_HOST,
                                     hold_s=hold_s, max_bytes=MAX_REG_BYTES)


class NoFreeAtExpiryPush(PushP):
    """Does not free an expired lease while its WRITE is in flight: the blocks stay pinned until the WRITE ends
    (however long that is), past the reclaim bound."""

    def __init__(self, world):
        super().__init__(world)
        self.deferred = {}

    def hold_free(self, rank, end, t, local):
        super().hold_free(rank, end, t, local)
        in_flight = any(w.req_id == end.req_id and w.rank == rank and w.observed_local is None and w.outcome != "p_dead"
                        for w in self.records.writes)
        if end.outcome is Outcome.EXPIRED and in_flight:
            self.deferred[(end.req_id, rank)] = end
            return True
        return False

    def observe(self, write, t, local):
        end = self.deferred.pop((write.req_id, write.rank), None)
        if end is None:
            return super().observe(write, t, local)
        write.p_view = "freed_at_write_end"
        self.world._on_end(write.rank, end, t, local)


class ReleaseOnLateWritePush(PushP):
    """The WRITE ignores the expiry: a WRITE that completes after its lease expired frees the blocks again, as
    a release (vLLM's filter of expired requests out of the WRITEs done removed): a double free, no late write."""

    def observe(self, write, t, local):
        if write.outcome == "landed" and self.live(write.rank, write.req_id) is None:
            write.p_view = "released"
            self.world._on_end(write.rank, LeaseEnd(write.req_id, Outcome.RELEASED, local, None), t, local)
            return
        super().observe(write, t, local)


class WriteAfterExpiryPush(PushP):
    """P's writer matches a registration against a lease that already ended (blocks kept after the expiry's
    eviction): the WRITE reads blocks P freed."""

    def live(self, rank, req_id):
        return req_id if (req_id, rank) in self.world.leases else None
