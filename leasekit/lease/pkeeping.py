"""P's lease keeping for one worker (TP rank), as pure rules: grant, extend, complete, expire, bind, max
hold and pledge hold in one object.

LeaseKit's production P worker calls it (through :mod:`leasekit.vllm.prefill`, which mirrors every
decision into vLLM's own lease maps); the tests drive it directly. It composes three pure parts:

- :class:`leasekit.lease.table.PLeaseTable`: the live leases on an expiry heap (renew
  ``deadline = max(deadline, min(now + E, grant + max hold))``, O(1); reap in O(k log n)), the model of
  vllm 0.32.0 ``nixl/base_worker.py: _handle_heartbeat`` / ``_reap_expired_send_leases``;
- :class:`leasekit.lease.binding.LeaseBinding`: which D agent may move each lease;
- :class:`leasekit.lease.proof.LeaseProofs`: the tags a LeaseKit D proves a lease with; a plain (untagged)
  message for a lease not bound yet waits out the *claim window* (:meth:`PLeaseKeeping.in_claim_window`: while
  no heartbeat could move the deadline anyway, ``now < grant + L - E``) so that a stranger who knows a
  request id cannot take the lease from a D that will prove it: a plain heartbeat there neither binds nor
  extends, a plain completion is held (:meth:`PLeaseKeeping.due_plain`) and dropped as ``unproven`` if the
  lease is proven first;
- :class:`PledgeBook`: the grant pledge (:mod:`leasekit.lease.pledge`): a lease whose last completion
  arrives before its pledge ends is freed at the pledge's end, and a completion that arrives before the
  grant reached the worker waits for the grant and then for the whole pledge.

Times are seconds on P's worker clock, passed in (no clock is read here). Not thread-safe (P's engine
loop is the only caller).
"""

from __future__ import annotations

import hmac
from collections import deque
from typing import Callable, Hashable, Iterable

from leasekit.lease.binding import COUNTED, DUPLICATE, FOREIGN, NEEDS_PROOF, RELEASED, UNPROVEN, LeaseBinding
from leasekit.lease.codec import Completion, DecodeError, Heartbeat
from leasekit.lease.config import LeaseTiming
from leasekit.lease.pledge import RATE_FACTOR, PledgeBook  # noqa: F401 (PledgeBook: re-exported)
from leasekit.lease.proof import LeaseProofs, split_tagged
from leasekit.lease.table import Lease, LeaseEnd, Outcome, PLeaseTable, StepResult

HELD = "held"
"""A completion for a lease already completed and still pinned by its pledge (drop it as a duplicate)."""
NOT_LIVE = "not_live"
"""A completion for a request P does not hold (a late read, or an id P never held)."""
EARLY = "early"
"""The last completion arrived before the grant reached this worker: held until the grant, then the pledge."""
DEFERRED = "deferred"
"""The last completion arrived inside the lease's pledge: freed at the pledge's end (:meth:`PledgeBook.due`)."""
CLAIM_WAIT = "claim_wait"
"""A plain message for a lease not bound yet, inside its claim window: a heartbeat has no effect, a completion is
held until the window ends (:meth:`PLeaseKeeping.due_plain`)."""
PROVEN, PLAIN = "proven", "plain"
"""Kinds of binding :attr:`PLeaseKeeping.on_binding` reports: a lease bound by a proof, or by a plain first
contact (unprotected: a stock D, or a D that did not prove it within the claim window)."""
MAX_HELD_PLAIN = 65536
"""Leases with plain completions held through their claim windows at once (beyond it, the oldest window is
ended early)."""
COMPLETION_OUTCOMES = (HELD, NOT_LIVE, DUPLICATE, FOREIGN, UNPROVEN, CLAIM_WAIT, COUNTED, EARLY, DEFERRED, RELEASED)
"""Outcomes of :meth:`PLeaseKeeping.completion`: ``released`` frees the blocks now."""


class PLeaseKeeping:
    """The leases of one P worker with their binding and pledges (see the module docstring).

    Args:
        timing: ``L``/``H``/``E`` in force.
        max_hold_s: seconds after a grant past which no heartbeat moves a lease's deadline
            (``leasekit_max_hold_s``; at least ``L``).
        pledge_s: the grant pledge ``W`` in seconds (``leasekit_pledge_s``; 0: none).
        rate_factor: ``K``, the clock-rate stretch of a pledge on another clock (default
            :data:`leasekit.lease.pledge.RATE_FACTOR`).
        proofs: the tag checker (:class:`leasekit.lease.proof.LeaseProofs`); while its key is None (a P that
            mints no lease secret) every lease is plain and no claim window applies.
        on_binding: called with :data:`PROVEN` or :data:`PLAIN` each time a lease is bound (a plain lease
            proven later reports both).

    Raises:
        ValueError: ``max_hold_s`` shorter than ``L`` (from :class:`PLeaseTable`), ``pledge_s`` negative.
    """

    def __init__(self, timing: LeaseTiming, *, max_hold_s: float, pledge_s: float = 0.0, rate_factor: float = RATE_FACTOR,
                 proofs: LeaseProofs | None = None, on_binding: Callable[[str], None] | None = None):
        if not pledge_s >= 0:
            raise ValueError(f"pledge_s must be >= 0 seconds, got {pledge_s!r}")
        self.table = PLeaseTable(timing, ended_memory=0, max_buffered=0, max_hold_s=max_hold_s)
        self.binding = LeaseBinding()
        self.pledges = PledgeBook()
        self.proofs = proofs if proofs is not None else LeaseProofs()
        self.on_binding = on_binding if on_binding is not None else (lambda kind: None)
        self.max_hold_s, self.pledge_s, self.rate_factor = max_hold_s, pledge_s, rate_factor
        self.claim_window_s = max(0.0, timing.lease_duration_s - timing.extension_s)
        """Seconds after a grant during which a plain message cannot bind the lease (``L - E``)."""
        self.voided = 0
        """Held plain completions dropped because their lease was proven first (a counter; the caller reads it)."""
        self.held_plain: dict[str, list[tuple[str, int]]] = {}  # request id -> plain completions in its window
        self._held_due: deque[tuple[float, str]] = deque()  # (window end, request id), in arrival order
        self._pinned: dict[str, Lease] = {}  # step(): leases a pledge holds after their last completion

    def in_claim_window(self, req_id: str, now: float) -> bool:
        """Whether a plain message for ``req_id`` at ``now`` falls in the lease's claim window: P mints lease
        secrets, the lease is not bound yet, and ``now < grant + L - E`` (a lease not in the table, prefilled
        but not granted on this worker yet, is in its window)."""
        if self.proofs.key is None or req_id in self.binding:
            return False
        lease = self.table.get(req_id)
        return lease is None or now < lease.granted_at_s + self.claim_window_s

    def heartbeat(self, req_id: str, agent: str, now: float, extension_s: float, tag: str | None = None
                  ) -> float | str | None:
        """One heartbeat of ``agent`` naming ``req_id`` (``tag``: its heartbeat tag, or None: plain) at ``now``:
        None if ``req_id`` is not live; ``foreign`` (plain, bound to another agent), ``unproven`` (plain or a
        wrong tag on a proven lease, or a tag that does not verify) or ``claim_wait`` (plain first contact in
        the claim window: no effect); else the deadline now in force (``max(deadline, min(now + E, grant +
        max hold))``). A plain heartbeat binds an untouched lease past its window; a good tag proves it."""
        lease = self.table.get(req_id)
        if lease is None:
            return None
        key = lease.req_id  # the granted id object, not the one parsed from this message
        binding = self.binding
        if tag is None:
            if key not in binding:  # a plain first contact
                if self.proofs.key is not None and now < lease.granted_at_s + self.claim_window_s:
                    return CLAIM_WAIT  # its D may still prove it; the deadline could not move anyway
                binding.heartbeat(key, agent)
                self.on_binding(PLAIN)
                return self.table.renew(key, now, extension_s)
            allowed = binding.heartbeat(key, agent)
            if allowed is True:
                return self.table.renew(key, now, extension_s)
            return UNPROVEN if allowed is UNPROVEN else FOREIGN
        wire = bytes.fromhex(tag)  # 8 bytes: what the binding keeps per proven lease (memory)
        allowed = binding.heartbeat(key, agent, wire)
        if allowed is NEEDS_PROOF:
            expected = self.proofs.heartbeat_tag(key)
            if expected is None or not hmac.compare_digest(bytes.fromhex(expected), wire):
                return UNPROVEN
            if binding.prove(key, wire):
                self.on_binding(PROVEN)
        elif allowed is not True:
            return UNPROVEN
        return self.table.renew(key, now, extension_s)

    def completion(self, req_id: str, agent: str, expected_consumers: int, now: float, *, granted: bool,
                   prefilled: bool, tag: str | None = None, verified: bool = False) -> str:
        """One completion ``"<req_id>:<expected_consumers>"`` of ``agent`` at ``now``, with its completion
        ``tag`` (None: plain); ``granted``: the lease is live on the worker, ``prefilled``: P prefilled the
        request and its grant may still come. Returns one of :data:`COMPLETION_OUTCOMES`; on ``released``,
        ``deferred`` and ``early`` the lease left the table (its binding too); ``claim_wait``: held until the
        window ends (:meth:`due_plain`); ``verified``: the caller already checked ``tag``. Raises ValueError:
        ``expected_consumers`` < 1."""
        if self.pledges.holding(req_id):
            return HELD
        if not (granted or prefilled):
            return NOT_LIVE
        proven = tag is not None
        if proven:
            if not verified and not self.proofs.completion_ok(req_id, expected_consumers, tag):
                return UNPROVEN
            if not self.binding.proven(req_id) and self.binding.prove(req_id, bytes.fromhex(self.proofs.heartbeat_tag(req_id))):
                self.on_binding(PROVEN)
        elif self.in_claim_window(req_id, now):
            return self._hold_plain(req_id, agent, expected_consumers, now, granted)
        fresh = not proven and req_id not in self.binding
        result = self.binding.completion(req_id, agent, expected_consumers, proven=proven)
        if fresh and result not in (FOREIGN, UNPROVEN):
            self.on_binding(PLAIN)
        if result != RELEASED:
            return result
        if self.held_plain:
            self._void_held(req_id)
        if not granted:
            self.pledges.early[req_id] = now
            return EARLY
        self.table.discard(req_id)
        return DEFERRED if self.pledges.defer(req_id, now) else RELEASED

    def _hold_plain(self, req_id: str, agent: str, expected_consumers: int, now: float, granted: bool) -> str:
        held = self.held_plain.get(req_id)
        if held is None:
            lease = self.table.get(req_id) if granted else None
            end = (lease.granted_at_s if lease is not None else now) + self.claim_window_s
            held = self.held_plain[req_id] = []
            self._held_due.append((end, req_id))
            if len(self._held_due) > MAX_HELD_PLAIN:  # a flood: end the oldest window now
                self._held_due[0] = (float("-inf"), self._held_due[0][1])
        if len(held) < 64 and all(a != agent for a, _ in held):
            held.append((agent, expected_consumers))
        return CLAIM_WAIT

    def due_plain(self, now: float) -> list[tuple[str, str, int]]:
        """Remove and return the held plain completions whose lease's claim window ended by ``now`` and that no
        proof voided: ``(request id, agent, expected consumers)`` in arrival order; the caller applies each
        with :meth:`completion` (outside the window now). Those of a lease proven meanwhile are dropped and
        counted in :attr:`voided`; those of a lease that ended are dropped."""
        out: list[tuple[str, str, int]] = []
        due = self._held_due
        while due and due[0][0] <= now:
            _, req_id = due.popleft()
            held = self.held_plain.pop(req_id, None)
            if held is None:
                continue
            if self.binding.proven(req_id):
                self.voided += len(held)
                continue
            out.extend((req_id, agent, n) for agent, n in held)
        return out

    def grant_arrived(self, req_id: str, now: float) -> None:
        """The grant of an :data:`EARLY` completion reached the worker: freed after the whole pledge."""
        self.table.discard(req_id)
        self.pledges.grant_arrived(req_id, now, self.pledge_s * self.rate_factor)

    def forget(self, req_id: str) -> None:
        """``req_id``'s lease ended another way (expired, aborted): drop its binding, pledge and held plain
        completions."""
        self.binding.forget(req_id)
        self.pledges.holds.pop(req_id, None)
        if self.held_plain:
            self._void_held(req_id)

    def _void_held(self, req_id: str) -> None:
        """The lease ended: plain completions still held for it are void (counted in :attr:`voided`)."""
        self.voided += len(self.held_plain.pop(req_id, ()))

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
        get = self.table.get
        for sender, message in notifications:
            agent = str(sender)
            if isinstance(message, Heartbeat):
                for wire_id in message.req_ids:
                    req_id, tag = wire_id, None
                    if get(wire_id) is None:
                        split = split_tagged(wire_id)
                        if split is not None and get(split[0]) is not None:
                            req_id, tag = split
                    if self.heartbeat(req_id, agent, now_s, extension, tag) is None:
                        result.unknown_heartbeat_ids.append(wire_id)
            elif isinstance(message, Completion):
                self._step_completion(result, message.req_id, agent, message.expected_consumers, now_s)
            else:
                result.errors.append(message)
        for req_id, agent, n in self.due_plain(now_s):
            self._step_completion(result, req_id, agent, n, now_s)
        for req_id, _held in self.pledges.due(now_s):
            lease = pinned.pop(req_id, None)
            if lease is not None:
                result.ended.append(LeaseEnd(req_id, Outcome.RELEASED, now_s, lease))
        for end in self.table.reap(now_s):
            self.forget(end.req_id)
            result.ended.append(end)
        return result

    def _step_completion(self, result: StepResult, wire_id: str, agent: str, n: int, now_s: float) -> None:
        req_id, tag = wire_id, None
        lease = self.table.get(wire_id)
        if lease is None:
            split = split_tagged(wire_id)
            if split is not None and (self.table.get(split[0]) is not None or self.pledges.holding(split[0])):
                req_id, tag = split
                lease = self.table.get(req_id)
        outcome = self.completion(req_id, agent, n, now_s, granted=lease is not None, prefilled=False, tag=tag)
        if outcome == RELEASED:
            result.ended.append(LeaseEnd(lease.req_id, Outcome.RELEASED, now_s, lease))
        elif outcome == DEFERRED:
            self._pinned[lease.req_id] = lease
        elif outcome == NOT_LIVE:
            result.late_completions.append(req_id)
