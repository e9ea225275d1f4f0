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
in ``_lk_deferred``. Its lease span ends ``released`` when the blocks are really freed, with
``leasekit.pledge_hold_s``; ``leasekit_kv_lease_pledge_hold_seconds`` observes the same seconds.
"""

from __future__ import annotations

import math
import time
from typing import Any

from leasekit.lease.pledge import RATE_FACTOR
from leasekit.telemetry import semconv as sc
from leasekit.vllm.clockid import local_clock_id
from leasekit.vllm.scheduler import METADATA_PLEDGE_CLOCK_ATTR, METADATA_PLEDGES_ATTR


class PPledgeHolds:
    """Mixin for LeaseKitConnector's NIXL worker (needs vLLM's ``_reqs_to_send`` and LeaseKit's ``_lk``
    span recorder, ``_lk_stats``); a base of :class:`leasekit.vllm.prefill.notifications.PNotificationHandling`,
    whose ``_lk_init_notifications`` calls :meth:`_lk_init_pledges`."""

    def _lk_init_pledges(self, pledge_s: float = 0.0) -> None:
        """``pledge_s``: P's ``leasekit_pledge_s`` (seconds; 0 when this P makes no pledge)."""
        self._lk_pledge_s = pledge_s
        self._lk_clock_id = local_clock_id()  # named in every heartbeat acknowledgement
        self._lk_pledge_holds: dict[str, float] = {}  # P request id -> pledge end, this worker's clock
        self._lk_deferred: dict[str, tuple[float, float]] = {}  # P request id -> (pledge end, completion time)
        self._lk_early: dict[str, float] = {}  # completed before its grant reached this worker -> when

    def _lk_take_pledges(self, metadata: Any) -> None:
        """Once per step, after vLLM applied the step's metadata (``reqs_not_processed``, ``reqs_to_send``):
        record the new grants' pledges, and release the completions that came before their grant.

        A worker on the scheduler's clock (same clock id) holds until ``now + (until - scheduler_clock)``,
        never earlier than ``until``; one on another clock (another host) holds that span times ``K``, so
        that a clock running 10 % fast still holds past the scheduler's ``until``. A hold that is not a
        finite number, or longer than ``W * K``, and any failure here, fall back to ``now + W * K``: never
        earlier than the pledge (the grant came before ``now``)."""
        now = time.perf_counter()
        longest = self._lk_pledge_s * RATE_FACTOR
        granted = [r for r in (getattr(metadata, "reqs_to_send", None) or ()) if r in self._reqs_to_send]
        try:
            pledges = getattr(metadata, METADATA_PLEDGES_ATTR, None) or {}
            scheduler_clock = getattr(metadata, "scheduler_clock", None)
            same = self._lk_clock_id is not None and getattr(metadata, METADATA_PLEDGE_CLOCK_ATTR, None) == self._lk_clock_id
            for req_id, until in pledges.items():
                if req_id not in self._reqs_to_send:
                    continue
                span = float(until) - float(scheduler_clock) if scheduler_clock else float(until) - now
                hold = now + (span if same else span * RATE_FACTOR)
                self._lk_pledge_holds[req_id] = hold if math.isfinite(hold) and hold <= now + longest else now + longest
        except Exception as exc:  # the holds are P's promise: hold for the whole pledge instead
            for req_id in granted:
                self._lk_pledge_holds[req_id] = now + longest
            self._lk_pledge_warning.warn("LeaseKit: recording grant pledges failed (%s: %s); holding this step's "
                                         "leases for the whole pledge", type(exc).__name__, exc, event="pledge_error")
        try:
            if self._lk_early:
                self._lk_release_early(now)
            for req_id in granted:
                if req_id in self._lk_pledge_holds:
                    self._lk.annotate(req_id, {sc.PLEDGE_UNTIL_MONOTONIC_S: self._lk_pledge_holds[req_id]})
        except Exception as exc:  # never into the engine loop; an early completion not moved stays held
            self._lk_pledge_warning.warn("LeaseKit: grant pledge bookkeeping failed: %s: %s", type(exc).__name__, exc,
                                         event="pledge_error")

    def _lk_park_early(self, req_id: str, now: float) -> None:
        """A completion released ``req_id`` before its grant reached this worker (the request is in
        ``_reqs_to_process``, not yet in ``_reqs_to_send``): P holds it until the grant arrives, then
        for ``W * K`` more (:meth:`_lk_release_early`). Stock vLLM would free a request that may still be
        prefilling (and trip the scheduler's ``request.is_finished()`` assertion)."""
        self._lk_early[req_id] = now

    def _lk_release_early(self, now: float) -> None:
        for req_id, completed in list(self._lk_early.items()):
            if req_id not in self._reqs_to_process:  # aborted on P (reqs_not_processed): nothing to free
                del self._lk_early[req_id]
                self._lk_forget_consumer_counts(req_id)
            elif req_id in self._reqs_to_send:  # its grant arrived: the completion takes effect now
                del self._lk_early[req_id]
                hold = max(self._lk_pledge_holds.pop(req_id, now), now + self._lk_pledge_s * RATE_FACTOR)
                self._lk_take_out(req_id)
                self._lk_deferred[req_id] = (hold, completed)  # freed at the first step at or after hold

    def _lk_forget_consumer_counts(self, req_id: str) -> None:
        """Drop vLLM's per-request consumer notification counts of ``req_id``."""
        self.consumer_notification_counts_by_req.pop(req_id, None)
        self.expected_consumer_notifications_by_req.pop(req_id, None)

    def _lk_take_out(self, req_id: str) -> None:
        """Remove a released lease from vLLM's lease maps (counts, ``_reqs_to_process``, ``_reqs_to_send``):
        no heartbeat extends it and the reaper never sees it; the caller reports it done now or defers it."""
        self._lk_forget_consumer_counts(req_id)
        self._reqs_to_process.discard(req_id)
        self._reqs_to_send.pop(req_id, None)
        self._lk_leases.discard(req_id)

    def _lk_defer_release(self, req_id: str, now: float) -> bool:
        """Whether ``req_id``'s release (its completion arrived at ``now``) waits for its pledge's end;
        if so it is kept in ``_lk_deferred``. The caller has removed it from vLLM's lease maps."""
        hold = self._lk_pledge_holds.pop(req_id, None)
        if hold is None or now >= hold:
            return False
        self._lk_deferred[req_id] = (hold, now)
        return True

    def _lk_release_deferred(self, now: float, done: set[str]) -> None:
        """Add to ``done`` (``finished_sending``) every deferred lease whose pledge ended by ``now``.
        The id is handed to vLLM before any telemetry, so a telemetry failure cannot keep blocks pinned."""
        if not self._lk_deferred:
            return
        for req_id, (hold, completed) in list(self._lk_deferred.items()):
            if now < hold:
                continue
            del self._lk_deferred[req_id]
            done.add(req_id)
            held = max(0.0, now - completed)
            try:
                self._lk.annotate(req_id, {sc.PLEDGE_HOLD_S: held})
                self._lk.release(req_id, now=now)
                self._lk_stats.pledge_hold(held)
            except Exception as exc:
                self._lk_pledge_warning.warn("LeaseKit: pledge release telemetry failed: %s: %s", type(exc).__name__,
                                             exc, event="pledge_release_error")

    def _lk_sweep_pledges(self) -> None:
        """Forget the pledges of leases that ended another way (expired, aborted): once per step, O(1)
        unless there is garbage."""
        if len(self._lk_pledge_holds) > len(self._reqs_to_send):
            self._lk_pledge_holds = {k: v for k, v in self._lk_pledge_holds.items() if k in self._reqs_to_send}
        if self._lk_early:  # aborted on P, or never granted (no blocks) for longer than the max hold
            oldest = time.perf_counter() - self._lk_max_hold_s
            for req_id in [k for k, t in self._lk_early.items() if k not in self._reqs_to_process or t < oldest]:
                del self._lk_early[req_id]
                self._lk_forget_consumer_counts(req_id)
