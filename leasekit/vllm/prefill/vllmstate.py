"""The one interface through which P's LeaseKit components reach vLLM's lease state on the NIXL worker.

vllm 0.32.0 and 0.33.0 keep P's leases in private attributes of the worker (``nixl/base_worker.py``,
``nixl/pull_worker.py``): ``_reqs_to_send`` (request id -> deadline, seconds on the worker's
``time.perf_counter``), ``_reqs_to_process`` (ids P prefilled whose lease may still come),
``consumer_notification_counts_by_req`` / ``expected_consumer_notifications_by_req`` (completions
counted / expected per request), ``_lease_extension`` (``E``, seconds) and ``xfer_stats`` (vLLM's NIXL
stats). :class:`VllmSendState` names each of them once (they are recorded per release in
:mod:`leasekit.vllm.version`); the components of :mod:`leasekit.vllm.prefill` read and write vLLM's
state only through it, and tests build it over plain dicts (:meth:`VllmSendState.standalone`).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any


class VllmSendState:
    """Live view of one P worker's vLLM lease state (the objects are vLLM's own, read and written in
    place; vLLM may rebind ``_reqs_to_send``, so it is looked up on every access).

    Args:
        worker: vLLM's ``NixlPullConnectorWorker`` (or anything with the attributes listed in the
            module docstring).
    """

    __slots__ = ("_worker",)

    def __init__(self, worker: Any):
        self._worker = worker

    @classmethod
    def standalone(cls, extension_s: float, stats: Any = None) -> "VllmSendState":
        """A state over fresh empty maps (tests, benchmarks): ``extension_s`` is ``E`` in seconds;
        ``stats`` needs ``record_notification_after_expiry()`` (default: a counter in ``after_expiry``)."""
        if stats is None:
            stats = SimpleNamespace(after_expiry=0)
            stats.record_notification_after_expiry = lambda: setattr(stats, "after_expiry", stats.after_expiry + 1)
        return cls(SimpleNamespace(_reqs_to_send={}, _reqs_to_process=set(), _lease_extension=extension_s,
                                   consumer_notification_counts_by_req=defaultdict(int),
                                   expected_consumer_notifications_by_req={}, xfer_stats=stats))

    @property
    def reqs_to_send(self) -> dict[str, float]:
        """vLLM's ``_reqs_to_send``: live leases, request id -> deadline (s, worker ``perf_counter``)."""
        return self._worker._reqs_to_send

    @property
    def reqs_to_process(self) -> set[str]:
        """vLLM's ``_reqs_to_process``: ids prefilled on P whose KV blocks D may still read."""
        return self._worker._reqs_to_process

    @property
    def consumer_counts(self) -> dict[str, int]:
        """vLLM's ``consumer_notification_counts_by_req`` (a ``defaultdict(int)``)."""
        return self._worker.consumer_notification_counts_by_req

    @property
    def lease_extension_s(self) -> float:
        """vLLM's ``_lease_extension``: ``E`` in seconds, what one heartbeat extends a lease to."""
        return self._worker._lease_extension

    def rebind_reqs_to_send(self, leases: dict[str, float]) -> None:
        """Point vLLM's ``_reqs_to_send`` at ``leases`` (the expiry heap narrows it around vLLM's reap)."""
        self._worker._reqs_to_send = leases

    def forget_consumer_counts(self, req_id: str) -> None:
        """Drop vLLM's per-request completion counts (counted and expected) of ``req_id``."""
        self._worker.consumer_notification_counts_by_req.pop(req_id, None)
        self._worker.expected_consumer_notifications_by_req.pop(req_id, None)

    def sweep_consumer_counts(self, keep: dict | set = frozenset()) -> int:
        """Drop vLLM's completion counts of requests that are in neither ``_reqs_to_send`` nor
        ``_reqs_to_process`` nor ``keep``; O(1) unless there are more counts than those. Returns how
        many were dropped."""
        counts = self._worker.consumer_notification_counts_by_req
        send, process = self._worker._reqs_to_send, self._worker._reqs_to_process
        if len(counts) <= len(send) + len(process) + len(keep):
            return 0
        stale = [k for k in counts if k not in send and k not in process and k not in keep]
        for req_id in stale:
            self.forget_consumer_counts(req_id)
        return len(stale)

    def take_out(self, req_id: str) -> None:
        """Remove a released lease from vLLM's lease maps (counts, ``_reqs_to_process``,
        ``_reqs_to_send``): no heartbeat extends it and vLLM's reaper never sees it."""
        self.forget_consumer_counts(req_id)
        self._worker._reqs_to_process.discard(req_id)
        self._worker._reqs_to_send.pop(req_id, None)

    def record_notification_after_expiry(self) -> None:
        """vLLM's ``notifications_after_expiry`` count (``xfer_stats``), for a late read."""
        self._worker.xfer_stats.record_notification_after_expiry()
