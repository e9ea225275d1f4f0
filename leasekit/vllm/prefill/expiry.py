"""The expiry heap of P's worker: which leases of vLLM's ``_reqs_to_send`` are due, in O(k log n).

vLLM 0.32.0 reaps by scanning every entry of ``_reqs_to_send`` each engine step
(``nixl/base_worker.py: _reap_expired_send_leases``; the dict is not ordered by expiry since
heartbeats move deadlines in place). :class:`ExpiryIndex` keeps a
:class:`leasekit.lease.table.PLeaseTable` (a min-heap with one entry per lease, renewals O(1)) in step
with that dict, so a step with nothing due costs O(1) whatever the number of live leases.

``_reqs_to_send`` stays the source of truth: every id the heap yields is checked against it (a deadline
moved behind the heap's back is indexed again), and the index is rebuilt from it whenever the two differ
in size and every :data:`AUDIT_INTERVAL_S` seconds, so a lease added or removed by a vLLM path LeaseKit
does not hook is still reaped on time.
"""

from __future__ import annotations

from typing import Callable, Container, Iterable

from leasekit.lease.table import Lease, PLeaseTable

AUDIT_INTERVAL_S = 30.0
"""Seconds between full checks that the heap indexes exactly vLLM's ``_reqs_to_send``."""


class ExpiryIndex:
    """The live leases of one P worker, indexed by deadline.

    Args:
        stamped: vLLM's ``_reqs_to_send`` (request id -> deadline, seconds on the worker's
            ``time.perf_counter``); read, never written.
        table: the table kept in step with it: P's :class:`leasekit.lease.pkeeping.PLeaseKeeping` table
            (its timing gives each lease's grant instant, ``deadline - L``, and its max hold caps renewals).

    Not thread-safe: P's engine loop is the only caller. All times are seconds on the worker clock.
    """

    def __init__(self, stamped: dict[str, float], table: PLeaseTable):
        self.stamped = stamped
        self._table = table
        self._audit_at = 0.0

    def __len__(self) -> int:
        return len(self._table)

    def get(self, req_id: str) -> Lease | None:
        """The indexed lease of ``req_id`` (its ``req_id`` is the granted id object), or None."""
        return self._table.get(req_id)

    def index(self, req_ids: Iterable[str], now: float) -> None:
        """Index ``req_ids`` (this step's grants) with the deadline vLLM stamped for each; an id vLLM does
        not hold is skipped, a re-stamped one takes its new deadline. O(log n) each."""
        table, stamped = self._table, self.stamped
        for req_id in req_ids:
            deadline = stamped.get(req_id)
            if deadline is None:
                continue
            lease = table.get(req_id)
            if lease is None:
                table.grant(req_id, now, deadline_s=deadline)
            elif lease.deadline_s != deadline:
                table.set_deadline(req_id, deadline)

    def renew(self, req_id: str, now: float, extension_s: float) -> float | None:
        """A delivered heartbeat: ``max(deadline, min(now + E, grant + max hold))``; the caller writes it
        to ``_reqs_to_send``. None if ``req_id`` is not indexed."""
        return self._table.renew(req_id, now, extension_s)

    def discard(self, req_id: str) -> None:
        """Forget ``req_id`` (its lease ended another way: released, or held for its pledge)."""
        self._table.discard(req_id)

    def due(self, now: float) -> dict[str, float]:
        """Remove and return the leases with ``deadline <= now`` (vLLM: ``now >= expires``), each with the
        deadline ``_reqs_to_send`` holds for it; they leave the index (the caller reaps them)."""
        stamped, table = self.stamped, self._table
        if len(table) != len(stamped) or now >= self._audit_at:
            self._audit_at = now + AUDIT_INTERVAL_S
            self.reindex(now)
        due: dict[str, float] = {}
        for end in table.reap(now):
            deadline = stamped.get(end.req_id)
            if deadline is None:
                continue
            if deadline > now:  # moved behind the heap's back: index it again (same grant: same max hold)
                table.grant(end.req_id, now, deadline_s=deadline, granted_at_s=end.lease.granted_at_s)
            else:
                due[end.req_id] = deadline
        return due

    def restore(self, leases: dict[str, float], now: float) -> None:
        """Index again leases :meth:`due` returned that the caller did not reap (id -> deadline)."""
        for req_id, deadline in leases.items():
            self._table.grant(req_id, now, deadline_s=deadline)

    def rebind(self, stamped: dict[str, float], now: float) -> None:
        """Index ``stamped`` instead (vLLM replaced its ``_reqs_to_send`` dict object): O(n), then as usual."""
        self.stamped = stamped
        self.reindex(now)

    def reindex(self, now: float) -> None:
        """Make the index exactly ``_reqs_to_send`` (ids and deadlines). O(n)."""
        table, stamped = self._table, self.stamped
        for req_id in table.ids():
            if req_id not in stamped:
                table.discard(req_id)
        self.index(stamped, now)

    def expiring_within(self, seconds: float, now: float) -> int:
        """Live leases whose deadline is less than ``seconds`` away (the expiring-soon gauge); O(k log n)."""
        return self._table.expiring_within(seconds, now)

    def reap(self, state, done_sending: set[str], vllm_reap: Callable[[set[str]], None], now: float,
             hold: Container[str] = ()) -> list[str]:
        """vLLM's own reap, on the leases due at ``now`` (s) only, less those in ``hold`` (indexed again, due at
        the next reap); returns the ids it added to ``done_sending`` (each expired lease once).

        ``state``: :class:`leasekit.vllm.prefill.vllmstate.VllmSendState`; ``vllm_reap``: vLLM's
        ``_reap_expired_send_leases`` bound to the worker (vllm 0.32.0 ``nixl/base_worker.py``), which
        scans ``_reqs_to_send``: it is called with that map narrowed to the due leases, so vLLM's
        accounting, stats and log line are unchanged, and the map is restored (less what vLLM reaped)
        even if it raises. A lease vLLM did not reap (cannot happen: due by the same clock) is indexed again."""
        stamped = state.reqs_to_send
        if self.stamped is not stamped:  # vLLM rebound its lease map: index the new one (O(n), once)
            self.rebind(stamped, now)
        due = self.due(now)
        if hold and due:
            kept = {req_id: due.pop(req_id) for req_id in [r for r in due if r in hold]}
            if kept:
                self.restore(kept, now)
        if not due:
            return []
        before = len(done_sending)
        already = set(done_sending) if before else ()
        narrowed = dict(due)
        state.rebind_reqs_to_send(narrowed)
        try:
            vllm_reap(done_sending)
        finally:
            state.rebind_reqs_to_send(stamped)
            for req_id in due:
                if req_id not in narrowed:  # vLLM reaped it
                    del stamped[req_id]
            self.restore(narrowed, now)
        if len(done_sending) == before:
            return []
        return [req_id for req_id in done_sending if req_id not in already]
