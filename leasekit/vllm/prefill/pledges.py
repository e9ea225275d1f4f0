"""P keeps the grant pledge (leasekit/lease/pledge.py): no block of a pledged lease is freed before the
pledge ends, even when D's completion arrives earlier.

P's scheduler writes ``[until_us, clock id]`` into the grant's ``kv_transfer_params`` and hands ``until`` (s)
and its clock id to the workers in the connector metadata (``leasekit_pledges``, ``leasekit_pledge_clock``).
Each worker rebases it onto its own clock as vLLM 0.32.0 rebases lease deadlines (``nixl/pull_worker.py``
``start_load_kv``: ``now_local + (t - scheduler_clock)``; on one clock that only lengthens it), and a
worker on another clock (another host) stretches the span by ``K`` (leasekit/lease/pledge.py). A completion that releases the
lease before that instant is answered and accounted as stock does, except that the request id is reported in
``finished_sending`` (the scheduler then frees the blocks) only at the first step at or after the pledge's
end: the lease leaves ``_reqs_to_send`` at once (no heartbeat extends it, the reaper never sees it) and waits
in :attr:`PledgeHolds.deferred`. Its lease span ends ``released`` when the blocks are really freed, with
``leasekit.pledge_hold_s``; ``leasekit_kv_lease_pledge_hold_seconds`` observes the same seconds.
"""

from __future__ import annotations

import math
from typing import Any

from leasekit.lease.pledge import RATE_FACTOR
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.lease.pkeeping import PLeaseKeeping
from leasekit.vllm.prefill.vllmstate import VllmSendState
from leasekit.vllm.scheduler import METADATA_PLEDGE_CLOCK_ATTR, METADATA_PLEDGES_ATTR


class PledgeHolds:
    """P's pledge holds for one worker, on vLLM's side (a component of LeaseKit's P worker): the rules are
    :class:`leasekit.lease.pkeeping.PLeaseKeeping`'s (its :class:`~leasekit.lease.pkeeping.PledgeBook`);
    this component reads the pledges from the connector metadata and mirrors the holds into vLLM's maps.

    Args:
        state: vLLM's lease state (:class:`leasekit.vllm.prefill.vllmstate.VllmSendState`).
        keeping: P's lease keeping (``pledge_s``: ``leasekit_pledge_s`` in seconds, 0 when this P makes
            no pledge; ``max_hold_s``: an early completion whose grant never comes is forgotten after it).
        recorder: the lease span recorder (``annotate``, ``release``).
        stats: the lease stats observer (``pledge_hold``).
        clock_id: this worker's clock id (:func:`leasekit.vllm.clockid.local_clock_id`; None: unknown),
            compared with the scheduler's to rebase a pledge on one clock.

    State (the keeping's): :attr:`deferred` (request id -> (pledge end, completion time), seconds on the
    worker clock), :attr:`early` (request id -> completion time), :attr:`holds` (request id -> pledge
    end). Never raises into the engine loop (failures hold longer and are logged).
    """

    def __init__(self, state: VllmSendState, keeping: PLeaseKeeping, recorder: Any, stats: Any, *,
                 clock_id: str | None = None):
        self.state, self.keeping, self.recorder, self.stats = state, keeping, recorder, stats
        self.book, self.clock_id = keeping.pledges, clock_id
        self.warning = RateLimitedWarning(lease_logger())

    @property
    def holds(self) -> dict[str, float]:
        """Request id -> pledge end (s, worker clock), for granted leases not yet completed."""
        return self.book.holds

    @property
    def deferred(self) -> dict[str, tuple[float, float]]:
        """Request id -> (pledge end, completion time): completed, freed at the pledge's end."""
        return self.book.deferred

    @property
    def early(self) -> dict[str, float]:
        """Request id -> completion time: completed before the grant reached this worker."""
        return self.book.early

    def take(self, metadata: Any, now: float) -> None:
        """Once per step at ``now`` (s), after vLLM applied the step's metadata (``reqs_not_processed``,
        ``reqs_to_send``): record the new grants' pledges, and release the completions that came before
        their grant.

        A worker on the scheduler's clock (same clock id) holds until ``now + (until - scheduler_clock)``,
        never earlier than ``until``; one on another clock (another host) holds that span times ``K``, so
        that a clock running 10 % fast still holds past the scheduler's ``until``. A hold that is not a
        finite number, or longer than ``W * K``, and any failure here, fall back to ``now + W * K``: never
        earlier than the pledge (the grant came before ``now``)."""
        send, holds = self.state.reqs_to_send, self.book.holds
        longest = self.keeping.pledge_s * RATE_FACTOR
        granted = [r for r in (getattr(metadata, "reqs_to_send", None) or ()) if r in send]
        try:
            pledges = getattr(metadata, METADATA_PLEDGES_ATTR, None) or {}
            scheduler_clock = getattr(metadata, "scheduler_clock", None)
            same = self.clock_id is not None and getattr(metadata, METADATA_PLEDGE_CLOCK_ATTR, None) == self.clock_id
            for req_id, until in pledges.items():
                if req_id not in send:
                    continue
                span = float(until) - float(scheduler_clock) if scheduler_clock else float(until) - now
                hold = now + (span if same else span * RATE_FACTOR)
                holds[req_id] = hold if math.isfinite(hold) and hold <= now + longest else now + longest
        except Exception as exc:  # the holds are P's promise: hold for the whole pledge instead
            for req_id in granted:
                holds[req_id] = now + longest
            self.warning.warn("LeaseKit: recording grant pledges failed (%s: %s); holding this step's "
                              "leases for the whole pledge", type(exc).__name__, exc, event="pledge_error")
        try:
            if self.book.early:
                self._release_early(now)
            for req_id in granted:
                if req_id in holds:
                    self.recorder.annotate(req_id, {sc.PLEDGE_UNTIL_MONOTONIC_S: holds[req_id]})
        except Exception as exc:  # never into the engine loop; an early completion not moved stays held
            self.warning.warn("LeaseKit: grant pledge bookkeeping failed: %s: %s", type(exc).__name__, exc,
                              event="pledge_error")

    def _release_early(self, now: float) -> None:
        """Early completions (see :data:`leasekit.lease.pkeeping.EARLY`; stock vLLM would free a request
        that may still be prefilling and trip the scheduler's ``request.is_finished()`` assertion): one
        aborted on P (``reqs_not_processed``) is forgotten, one whose grant arrived waits ``W * K`` more."""
        state = self.state
        for req_id in list(self.book.early):
            if req_id not in state.reqs_to_process:  # aborted on P: nothing to free
                self.keeping.forget_early(req_id)
                state.forget_consumer_counts(req_id)
            elif req_id in state.reqs_to_send:  # its grant arrived: the completion takes effect now
                self.keeping.grant_arrived(req_id, now)
                state.take_out(req_id)  # freed at the first step at or after the hold

    def release_due(self, now: float, done: set[str]) -> None:
        """Add to ``done`` (``finished_sending``) every deferred lease whose pledge ended by ``now`` (s).
        The id is handed to vLLM before any telemetry, so a telemetry failure cannot keep blocks pinned."""
        for req_id, held in self.book.due(now):
            done.add(req_id)
            try:
                self.recorder.annotate(req_id, {sc.PLEDGE_HOLD_S: held})
                self.recorder.release(req_id, now=now)
                self.stats.pledge_hold(held)
            except Exception as exc:
                self.warning.warn("LeaseKit: pledge release telemetry failed: %s: %s", type(exc).__name__,
                                  exc, event="pledge_release_error")

    def sweep(self, now: float) -> None:
        """Forget the pledges of leases that ended another way (expired, aborted), completion counts of
        requests P no longer holds (counted before a grant that never came: stock vLLM keeps them for
        ever), and early completions whose request was aborted on P or never granted within the max hold:
        once per step at ``now`` (s), O(1) unless there is garbage."""
        send, book = self.state.reqs_to_send, self.book
        if len(book.holds) > len(send):
            book.holds = {k: v for k, v in book.holds.items() if k in send}
        self.state.sweep_consumer_counts(book.early)
        if book.early:
            oldest, process = now - self.keeping.max_hold_s, self.state.reqs_to_process
            for req_id in [k for k, t in book.early.items() if k not in process or t < oldest]:
                self.keeping.forget_early(req_id)
                self.state.forget_consumer_counts(req_id)
