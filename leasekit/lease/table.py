"""P's lease table for one worker (TP rank): grant, renew, complete, release, abort, reap.

The reference model of vllm 0.32.0 ``base_worker.py`` / ``pull_worker.py`` (``_reqs_to_send``,
``_handle_heartbeat``, ``_get_new_notifs``, ``_reap_expired_send_leases``), shaped like etcd's
``server/lease`` (``lessor.go``: every transition named; ``lease_queue.go``: an expiry heap).

- Renew: ``deadline = max(deadline, now + E)`` — never shorter.
- Reap: every lease with ``deadline <= now`` (vLLM: ``now >= expires``; the deadline instant is
  expired), found through a min-heap with one entry per lease, so a step with nothing expired costs
  O(1). Deadlines only grow, so an entry is always a lower bound of its lease's deadline: a renewal
  touches only the lease (O(1)); when a stale entry surfaces at the top it is pushed back with the
  current deadline (O(log n)). Entries of ended leases are dropped as they surface, and the heap is
  compacted if such garbage ever exceeds the live leases.
- Drain before reap: :meth:`PLeaseTable.step` handles every notification of the step first.
- Completions are counted per consumer rank (distinct senders; a sender-less completion counts
  once per message, as vLLM counts messages). A completion before its grant is buffered (bounded,
  for ``L`` seconds) and matched at the grant. Unknown and late ids are counted, never fatal.
- Release, abort and expiry are idempotent: each lease ends exactly once.

Times are seconds on P's monotonic clock, passed in (no clock is read here).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Iterable

from leasekit.lease.codec import Completion, DecodeError, Heartbeat
from leasekit.lease.config import LeaseTiming


class Outcome(str, Enum):
    """How a lease ended."""

    RELEASED = "released"
    EXPIRED = "expired"
    ABORTED = "aborted"


@dataclass(slots=True)
class Lease:
    """One live lease. ``deadline_s`` only grows (renewals take the max)."""

    req_id: str
    granted_at_s: float
    deadline_s: float
    kv_blocks: int = 0
    token: int = 0
    expected_consumers: int | None = None
    consumers: set | None = None  # distinct senders that completed (made at the first one)
    completions: int = 0
    extend_count: int = 0
    last_heartbeat_s: float | None = None


@dataclass(frozen=True, slots=True)
class LeaseEnd:
    """A lease that ended: ``outcome`` at ``at_s`` (seconds), with its final state."""

    req_id: str
    outcome: Outcome
    at_s: float
    lease: Lease


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """What one completion notification did.

    ``kind``: ``released`` (last consumer: ``end`` set), ``counted`` (more consumers to come),
    ``duplicate`` (this sender already counted), ``buffered`` (no lease yet: kept for a grant),
    ``late`` (the lease already ended: the read may have used freed blocks), ``invalid`` (bad count).
    """

    kind: str
    end: LeaseEnd | None = None


@dataclass
class StepResult:
    """One engine step: ends (releases then expiries, in order), and what was ignored."""

    ended: list[LeaseEnd] = field(default_factory=list)
    unknown_heartbeat_ids: list[str] = field(default_factory=list)
    late_completions: list[str] = field(default_factory=list)
    errors: list[DecodeError] = field(default_factory=list)


class PLeaseTable:
    """The leases of one P worker.

    Args:
        timing: ``L``/``H``/``E`` in force.
        ended_memory: how many ended ids to remember, to tell late completions and heartbeats
            (for a lease that ended) from unknown ids.
        max_buffered: cap on completions buffered before their grant (oldest dropped, counted).

        max_hold_s: seconds after its grant past which no renewal moves a lease's deadline (the max-hold
            cap, ``leasekit_max_hold_s``); None: no cap.

    Raises:
        ValueError: ``ended_memory`` or ``max_buffered`` negative, ``max_hold_s`` shorter than ``L``.

    Counters (``counters``): granted, extended, released, expired, aborted, completions,
    duplicate_completions, buffered_completions, buffer_dropped, late_completions,
    unknown_heartbeat_ids, decode_errors.
    """

    def __init__(self, timing: LeaseTiming, *, ended_memory: int = 65536, max_buffered: int = 4096,
                 max_hold_s: float | None = None):
        if ended_memory < 0 or max_buffered < 0:
            raise ValueError("ended_memory and max_buffered must be >= 0")
        if max_hold_s is not None and not max_hold_s >= timing.lease_duration_s:
            raise ValueError(f"max_hold_s must be >= L = {timing.lease_duration_s} s, got {max_hold_s!r}")
        self.timing = timing
        self.max_hold_s = max_hold_s
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._tokens = 0
        self._ended: OrderedDict[str, Outcome] = OrderedDict()
        self._ended_memory = ended_memory
        # req_id -> (first seen at, expected consumers, senders, sender-less count)
        self._buffered: OrderedDict[str, tuple[float, int, set, int]] = OrderedDict()
        self._max_buffered = max_buffered
        self.counters: Counter[str] = Counter()

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._leases

    def get(self, req_id: str) -> Lease | None:
        """The live lease for ``req_id``, or None."""
        return self._leases.get(req_id)

    def leases(self) -> list[Lease]:
        """The live leases (a copy of the list; the Lease objects are live)."""
        return list(self._leases.values())

    def next_deadline(self) -> float | None:
        """The earliest live deadline (seconds), or None; O(1) amortised."""
        self._drop_stale_top()
        return self._heap[0][0] if self._heap else None

    def ended_outcome(self, req_id: str) -> Outcome | None:
        """How a recently ended lease ended (None if unknown or forgotten)."""
        return self._ended.get(req_id)

    # -- transitions -----------------------------------------------------------------------
    def grant(self, req_id: str, now_s: float, *, kv_blocks: int = 0, duration_s: float | None = None,
              deadline_s: float | None = None, granted_at_s: float | None = None) -> Lease | LeaseEnd:
        """Pin ``req_id``'s blocks until ``now + L`` (or ``now + duration_s``, or exactly ``deadline_s``).

        ``deadline_s``: the deadline vLLM stamped (P's worker rebases the scheduler's ``now + L`` onto
        its own clock, vllm 0.32.0 ``nixl/pull_worker.py: start_load_kv``); the grant instant is then
        ``deadline_s - L`` unless ``granted_at_s`` gives it (a lease indexed again keeps its grant, and
        so its max-hold cap).

        Returns the new lease, or its :class:`LeaseEnd` if buffered completions already cover all
        consumers (the read finished before the grant: K06). Granting a live id returns it unchanged.
        """
        live = self._leases.get(req_id)
        if live is not None:
            return live
        if deadline_s is None:
            deadline_s = now_s + (self.timing.lease_duration_s if duration_s is None else duration_s)
            granted_at = now_s
        else:
            granted_at = deadline_s - self.timing.lease_duration_s if granted_at_s is None else granted_at_s
        self._tokens += 1
        lease = Lease(req_id, granted_at, deadline_s, kv_blocks, self._tokens)
        self._leases[req_id] = lease
        self._ended.pop(req_id, None)
        self._push(lease)
        self.counters["granted"] += 1
        buffered = self._buffered.pop(req_id, None)
        if buffered is not None:
            _, expected, senders, anonymous = buffered
            lease.expected_consumers = expected
            lease.consumers = set(senders)
            lease.completions = len(senders) + anonymous
            if lease.completions >= expected:
                return self._end(lease, Outcome.RELEASED, now_s)
        return lease

    def heartbeat(self, req_ids: Iterable[str], now_s: float) -> list[str]:
        """Renew every named live lease to ``max(deadline, now + E)``; returns the unknown ids."""
        unknown = [req_id for req_id in req_ids if self.renew(req_id, now_s) is None]
        self.counters["unknown_heartbeat_ids"] += len(unknown)
        return unknown

    def renew(self, req_id: str, now_s: float, extension_s: float | None = None) -> float | None:
        """One delivered heartbeat naming ``req_id``: ``deadline = max(deadline, min(now + E, cap))``
        (vllm 0.32.0 ``nixl/base_worker.py: _handle_heartbeat``, plus the max-hold cap). O(1).

        ``extension_s``: ``E`` in seconds (default ``timing.extension_s``; P's worker passes vLLM's own
        ``_lease_extension``). Returns the deadline now in force, or None if ``req_id`` is not live."""
        lease = self._leases.get(req_id)
        if lease is None:
            return None
        new = now_s + (self.timing.extension_s if extension_s is None else extension_s)
        if self.max_hold_s is not None:
            new = min(new, lease.granted_at_s + self.max_hold_s)
        lease.extend_count += 1
        lease.last_heartbeat_s = now_s
        if new > lease.deadline_s:
            lease.deadline_s = new  # its heap entry stays a valid lower bound
        self.counters["extended"] += 1
        return lease.deadline_s

    def expiring_within(self, seconds: float, now_s: float) -> int:
        """How many live leases have a deadline earlier than ``now + seconds`` (the "expiring soon"
        gauge). Cost O(k log n) for the k heap entries under the horizon, not O(n): each is popped; an
        entry whose lease was renewed past the horizon goes back with its current deadline (so it is not
        looked at again until that deadline comes near), one whose lease ended is dropped."""
        horizon = now_s + seconds
        heap, leases = self._heap, self._leases
        under: list[tuple[float, int, str]] = []
        while heap and heap[0][0] < horizon:
            _, token, req_id = heapq.heappop(heap)
            lease = leases.get(req_id)
            if lease is None or lease.token != token:
                continue  # the lease ended
            entry = (lease.deadline_s, token, req_id)
            if lease.deadline_s >= horizon:
                heapq.heappush(heap, entry)  # renewed: re-keyed past the horizon
            else:
                under.append(entry)
        for entry in under:
            heapq.heappush(heap, entry)
        return len(under)

    def completion(self, req_id: str, expected_consumers: int, now_s: float, sender: Hashable | None = None) -> CompletionResult:
        """Count one consumer's read completion (``"{req_id}:{n}"`` from ``sender``)."""
        if isinstance(expected_consumers, bool) or not isinstance(expected_consumers, int) or expected_consumers < 1:
            self.counters["invalid_completions"] += 1
            return CompletionResult("invalid")
        self.counters["completions"] += 1
        lease = self._leases.get(req_id)
        if lease is None:
            if req_id in self._ended:
                self.counters["late_completions"] += 1
                return CompletionResult("late")
            return self._buffer(req_id, expected_consumers, now_s, sender)
        lease.expected_consumers = expected_consumers  # every reader reports the same n (vLLM overwrites too)
        if sender is not None:
            if lease.consumers is None:
                lease.consumers = set()
            if sender in lease.consumers:
                self.counters["duplicate_completions"] += 1
                return CompletionResult("duplicate")
            lease.consumers.add(sender)
        lease.completions += 1
        if lease.completions >= expected_consumers:
            return CompletionResult("released", self._end(lease, Outcome.RELEASED, now_s))
        return CompletionResult("counted")

    def set_deadline(self, req_id: str, deadline_s: float) -> bool:
        """Set a live lease's deadline to exactly ``deadline_s`` (seconds), shorter or longer: vLLM
        re-stamps ``_reqs_to_send`` when a request is sent twice (``nixl/pull_worker.py: start_load_kv``).
        O(log n). False if ``req_id`` is not live."""
        lease = self._leases.get(req_id)
        if lease is None:
            return False
        if deadline_s < lease.deadline_s:  # the old entry is no longer a lower bound: retire it
            self._tokens += 1
            lease.token = self._tokens
            lease.deadline_s = deadline_s
            self._push(lease)
        else:
            lease.deadline_s = deadline_s
        return True

    def discard(self, req_id: str) -> bool:
        """Forget a live lease without an outcome (its end is recorded elsewhere); O(1). False if not live."""
        lease = self._leases.pop(req_id, None)
        return lease is not None

    def ids(self) -> list[str]:
        """The live leases' request ids (a copy)."""
        return list(self._leases)

    def release(self, req_id: str, now_s: float) -> LeaseEnd | None:
        """End a live lease as ``released`` (idempotent: None if not live)."""
        lease = self._leases.get(req_id)
        return None if lease is None else self._end(lease, Outcome.RELEASED, now_s)

    def abort(self, req_id: str, now_s: float) -> LeaseEnd | None:
        """End a live lease as ``aborted`` and drop buffered completions (idempotent)."""
        self._buffered.pop(req_id, None)
        lease = self._leases.get(req_id)
        return None if lease is None else self._end(lease, Outcome.ABORTED, now_s)

    def reap(self, now_s: float) -> list[LeaseEnd]:
        """End every lease with ``deadline <= now`` as ``expired`` (all of them, not head-only)."""
        ended: list[LeaseEnd] = []
        heap = self._heap
        while heap and heap[0][0] <= now_s:
            _, token, req_id = heap[0]
            lease = self._leases.get(req_id)
            if lease is None or lease.token != token:
                heapq.heappop(heap)  # the lease already ended
            elif lease.deadline_s > now_s:
                heapq.heapreplace(heap, (lease.deadline_s, token, req_id))  # renewed since pushed
            else:
                heapq.heappop(heap)
                ended.append(self._end(lease, Outcome.EXPIRED, now_s))
        self._expire_buffer(now_s)
        return ended

    def step(self, now_s: float, notifications: Iterable[tuple[Hashable | None, Heartbeat | Completion | DecodeError]] = ()) -> StepResult:
        """One engine step of P: drain every notification, then reap (vLLM order).

        ``notifications``: ``(sender, decoded message)`` pairs, as delivered since the last step.
        """
        result = StepResult()
        for sender, message in notifications:
            if isinstance(message, Heartbeat):
                result.unknown_heartbeat_ids.extend(self.heartbeat(message.req_ids, now_s))
            elif isinstance(message, Completion):
                outcome = self.completion(message.req_id, message.expected_consumers, now_s, sender)
                if outcome.end is not None:
                    result.ended.append(outcome.end)
                elif outcome.kind == "late":
                    result.late_completions.append(message.req_id)
            else:
                self.counters["decode_errors"] += 1
                result.errors.append(message)
        result.ended.extend(self.reap(now_s))
        return result

    # -- internals -------------------------------------------------------------------------
    def _push(self, lease: Lease) -> None:
        heapq.heappush(self._heap, (lease.deadline_s, lease.token, lease.req_id))
        if len(self._heap) > 2 * len(self._leases) + 1024:
            self._heap = [(l.deadline_s, l.token, l.req_id) for l in self._leases.values()]
            heapq.heapify(self._heap)

    def _drop_stale_top(self) -> None:
        heap = self._heap
        while heap:
            deadline, token, req_id = heap[0]
            lease = self._leases.get(req_id)
            if lease is None or lease.token != token:
                heapq.heappop(heap)
            elif lease.deadline_s > deadline:
                heapq.heapreplace(heap, (lease.deadline_s, token, req_id))
            else:
                return

    def _end(self, lease: Lease, outcome: Outcome, now_s: float) -> LeaseEnd:
        del self._leases[lease.req_id]
        self.counters[outcome.value] += 1
        if self._ended_memory:
            self._ended[lease.req_id] = outcome
            self._ended.move_to_end(lease.req_id)
            while len(self._ended) > self._ended_memory:
                self._ended.popitem(last=False)
        return LeaseEnd(lease.req_id, outcome, now_s, lease)

    def _buffer(self, req_id: str, expected: int, now_s: float, sender: Hashable | None) -> CompletionResult:
        first, _, senders, anonymous = self._buffered.get(req_id, (now_s, expected, set(), 0))
        if sender is not None and sender in senders:
            self.counters["duplicate_completions"] += 1
            return CompletionResult("duplicate")
        if sender is None:
            anonymous += 1
        else:
            senders.add(sender)
        self._buffered[req_id] = (first, expected, senders, anonymous)
        self.counters["buffered_completions"] += 1
        while len(self._buffered) > self._max_buffered:
            self._buffered.popitem(last=False)
            self.counters["buffer_dropped"] += 1
        return CompletionResult("buffered")

    def _expire_buffer(self, now_s: float) -> None:
        horizon = now_s - self.timing.lease_duration_s
        while self._buffered:
            req_id, (first, *_rest) = next(iter(self._buffered.items()))
            if first > horizon:
                return
            del self._buffered[req_id]
            self.counters["buffer_dropped"] += 1
