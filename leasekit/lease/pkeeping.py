"""P's lease keeping for one worker (TP rank), as pure rules: grant, extend, complete, expire, bind, max
hold and pledge hold in one object.

LeaseKit's production P worker calls it (through :mod:`leasekit.vllm.prefill`, which mirrors every
decision into vLLM's own lease maps); the tests drive it directly. It composes three pure parts:

- :class:`leasekit.lease.table.PLeaseTable`: the live leases on an expiry heap (renew
  ``deadline = max(deadline, min(now + E, grant + max hold))``, O(1); reap in O(k log n)), the model of
  vllm 0.32.0 ``nixl/base_worker.py: _handle_heartbeat`` / ``_reap_expired_send_leases``;
- :class:`leasekit.lease.binding.LeaseBinding`: which D agent may move each lease;
- :class:`PledgeBook`: the grant pledge (:mod:`leasekit.lease.pledge`): a lease whose last completion
  arrives before its pledge ends is freed at the pledge's end, and a completion that arrives before the
  grant reached the worker waits for the grant and then for the whole pledge.

Times are seconds on P's worker clock, passed in (no clock is read here). Not thread-safe (P's engine
loop is the only caller).
"""

from __future__ import annotations

from typing import Hashable, Iterable

from leasekit.lease.binding import COUNTED, DUPLICATE, FOREIGN, RELEASED, LeaseBinding
from leasekit.lease.codec import Completion, DecodeError, Heartbeat
from leasekit.lease.config import LeaseTiming
from leasekit.lease.pledge import RATE_FACTOR
from leasekit.lease.table import Lease, LeaseEnd, Outcome, PLeaseTable, StepResult

HELD = "held"
"""A completion for a lease already completed and still pinned by its pledge (drop it as a duplicate)."""
NOT_LIVE = "not_live"
"""A completion for a request P does not hold (a late read, or an id P never held)."""
EARLY = "early"
"""The last completion arrived before the grant reached this worker: held until the grant, then the pledge."""
DEFERRED = "deferred"
"""The last completion arrived inside the lease's pledge: freed at the pledge's end (:meth:`PledgeBook.due`)."""
COMPLETION_OUTCOMES = (HELD, NOT_LIVE, DUPLICATE, FOREIGN, COUNTED, EARLY, DEFERRED, RELEASED)
"""Outcomes of :meth:`PLeaseKeeping.completion`: ``released`` frees the blocks now."""


class PledgeBook:
    """P's pledge holds (pure). ``holds``: request id -> pledge end; ``deferred``: request id -> (pledge
    end, completion time); ``early``: request id -> completion time (completed before its grant). All
    times in seconds on the worker clock."""

    def __init__(self) -> None:
        self.holds: dict[str, float] = {}
        self.deferred: dict[str, tuple[float, float]] = {}
        self.early: dict[str, float] = {}

    def holding(self, req_id: str) -> bool:
        """Whether ``req_id`` completed and is still pinned (deferred for its pledge, or early)."""
        return req_id in self.deferred or req_id in self.early

    def defer(self, req_id: str, now: float) -> bool:
        """A release at ``now``: whether it waits for ``req_id``'s pledge (kept in :attr:`deferred`)."""
        hold = self.holds.pop(req_id, None)
        if hold is None or now >= hold:
            return False
        self.deferred[req_id] = (hold, now)
        return True

    def grant_arrived(self, req_id: str, now: float, longest_s: float) -> None:
        """The grant of an early completion reached the worker at ``now``: it is freed at
        ``max(pledge end, now + longest_s)`` (``longest_s``: the whole pledge ``W * K``, seconds)."""
        completed = self.early.pop(req_id)
        hold = max(self.holds.pop(req_id, now), now + longest_s)
        self.deferred[req_id] = (hold, completed)

    def due(self, now: float) -> list[tuple[str, float]]:
        """Remove and return the deferred leases whose pledge ended by ``now``: (request id, seconds held
        since the completion)."""
        if not self.deferred:
            return []
        out = []
        for req_id, (hold, completed) in list(self.deferred.items()):
            if now >= hold:
                del self.deferred[req_id]
                out.append((req_id, max(0.0, now - completed)))
        return out


class PLeaseKeeping:
    """The leases of one P worker with their binding and pledges (see the module docstring).

    Args:
        timing: ``L``/``H``/``E`` in force.
        max_hold_s: seconds after a grant past which no heartbeat moves a lease's deadline
            (``leasekit_max_hold_s``; at least ``L``).
        pledge_s: the grant pledge ``W`` in seconds (``leasekit_pledge_s``; 0: none).
        rate_factor: ``K``, the clock-rate stretch of a pledge on another clock (default
            :data:`leasekit.lease.pledge.RATE_FACTOR`).

    Raises:
        ValueError: ``max_hold_s`` shorter than ``L`` (from :class:`PLeaseTable`), ``pledge_s`` negative.
    """

    def __init__(self, timing: LeaseTiming, *, max_hold_s: float, pledge_s: float = 0.0, rate_factor: float = RATE_FACTOR):
        if not pledge_s >= 0:
            raise ValueError(f"pledge_s must be >= 0 seconds, got {pledge_s!r}")
        self.table = PLeaseTable(timing, ended_memory=0, max_buffered=0, max_hold_s=max_hold_s)
        self.binding = LeaseBinding()
        self.pledges = PledgeBook()
        self.max_hold_s, self.pledge_s, self.rate_factor = max_hold_s, pledge_s, rate_factor
        self._pinned: dict[str, Lease] = {}  # step(): leases a pledge holds after their last completion

    def heartbeat(self, req_id: str, agent: str, now: float, extension_s: float) -> float | str | None:
        """One heartbeat of ``agent`` naming ``req_id`` at ``now``: None if ``req_id`` is not live (nothing
        bound), ``foreign`` if the lease is bound to another agent (binding it on first contact), else the
        deadline now in force (``max(deadline, min(now + E, grant + max hold))``)."""
        lease = self.table.get(req_id)
        if lease is None:
            return None
        key = lease.req_id  # the granted id object, not the one parsed from this message
        if not self.binding.heartbeat(key, agent):
            return FOREIGN
        return self.table.renew(key, now, extension_s)

    def completion(self, req_id: str, agent: str, expected_consumers: int, now: float, *, granted: bool,
                   prefilled: bool) -> str:
        """One completion ``"<req_id>:<expected_consumers>"`` of ``agent`` at ``now``; ``granted``: the
        lease is live on the worker, ``prefilled``: P prefilled the request and its grant may still come.
        Returns one of :data:`COMPLETION_OUTCOMES`; on ``released``, ``deferred`` and ``early`` the lease
        left the table (its binding too). Raises ValueError: ``expected_consumers`` < 1."""
        if self.pledges.holding(req_id):
            return HELD
        if not (granted or prefilled):
            return NOT_LIVE
        result = self.binding.completion(req_id, agent, expected_consumers)
        if result != RELEASED:
            return result
        if not granted:
            self.pledges.early[req_id] = now
            return EARLY
        self.table.discard(req_id)
        return DEFERRED if self.pledges.defer(req_id, now) else RELEASED

    def grant_arrived(self, req_id: str, now: float) -> None:
        """The grant of an :data:`EARLY` completion reached the worker: freed after the whole pledge."""
        self.table.discard(req_id)
        self.pledges.grant_arrived(req_id, now, self.pledge_s * self.rate_factor)

    def forget(self, req_id: str) -> None:
        """``req_id``'s lease ended another way (expired, aborted): drop its binding and pledge."""
        self.binding.forget(req_id)
        self.pledges.holds.pop(req_id, None)

    def forget_early(self, req_id: str) -> None:
        """An early completion whose request was aborted on P, or never granted within the max hold."""
        self.pledges.early.pop(req_id, None)
        self.binding.forget(req_id)

    # -- one engine step, for the simulator (leasekit.sim.world: a ``table_factory``) ----------------------
    def grant(self, req_id: str, now_s: float, **kwargs) -> Lease | LeaseEnd:
        """Grant ``req_id`` at ``now_s`` (:meth:`PLeaseTable.grant`'s arguments)."""
        return self.table.grant(req_id, now_s, **kwargs)

    def leases(self) -> list[Lease]:
        """The live leases (:meth:`PLeaseTable.leases`)."""
        return self.table.leases()

    def step(self, now_s: float, notifications: Iterable[tuple[Hashable | None, Heartbeat | Completion | DecodeError]] = ()
             ) -> StepResult:
        """One engine step of P as LeaseKit's worker runs it: every notification (``(sender agent, decoded
        message)``) through these rules, then the pledges that ended, then the expiry heap's reap (drain
        before reap, vLLM's order). A completion for an id not live is ``not_live`` (the worker's grant is
        instantaneous here: nothing is prefilled without a lease). Returns the ends in that order."""
        result = StepResult()
        extension = self.table.timing.extension_s
        pinned = self._pinned
        for sender, message in notifications:
            agent = str(sender)
            if isinstance(message, Heartbeat):
                for req_id in message.req_ids:
                    if self.heartbeat(req_id, agent, now_s, extension) is None:
                        result.unknown_heartbeat_ids.append(req_id)
            elif isinstance(message, Completion):
                lease = self.table.get(message.req_id)
                outcome = self.completion(message.req_id, agent, message.expected_consumers, now_s,
                                          granted=lease is not None, prefilled=False)
                if outcome == RELEASED:
                    result.ended.append(LeaseEnd(lease.req_id, Outcome.RELEASED, now_s, lease))
                elif outcome == DEFERRED:
                    pinned[lease.req_id] = lease
                elif outcome == NOT_LIVE:
                    result.late_completions.append(message.req_id)
            else:
                result.errors.append(message)
        for req_id, _held in self.pledges.due(now_s):
            lease = pinned.pop(req_id, None)
            if lease is not None:
                result.ended.append(LeaseEnd(req_id, Outcome.RELEASED, now_s, lease))
        for end in self.table.reap(now_s):
            self.forget(end.req_id)
            result.ended.append(end)
        return result
