"""The push-mode part of LeaseKit's NIXL worker (:class:`leasekit.vllm.push.LeaseKitPushWorker`), between vLLM's
``nixl-push-writer`` thread and the engine thread. No vLLM import.

In push mode (vllm 0.32.0/0.33.0 ``nixl/push_worker.py``) the writer thread owns NIXL's ``get_new_notifs``: it
acts on ``PUSH_REG`` registrations itself and forwards every other notification, without its sender, to the
engine thread. :class:`PushFlow` takes that batch first (:meth:`PushFlow.writer_batch`, called by the
notification tap on the writer thread): registrations go through :class:`leasekit.lease.pushreg.PushRegGuard`
and only the accepted ones reach vLLM's writer; every other notification is kept *with its sender* for the
engine thread (:meth:`PushFlow.take_notifications`), where P's notification intake binds heartbeats to their D
agent as in pull mode. What the writer thread learns (drops, WRITEs issued) is queued and recorded on the engine
thread (:meth:`PushFlow.record`): spans, metrics and logs are only ever touched there.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from leasekit.lease.pushreg import PUSH_REG_PREFIX, PushRegGuard
from leasekit.lease.peerref import peer_ref

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """``request_id`` without vLLM's per-request ``-<8 hex>`` suffix (vllm 0.32.0 ``nixl/utils.py:
    get_base_request_id``, the rule vLLM's push writer matches a registration to P's request by)."""
    return _RANDOM_SUFFIX.sub("", request_id)


class PushFlow:
    """One push worker's registration guard, forwarded notifications and WRITE bookkeeping.

    Args:
        reqs_to_send: vLLM's ``_reqs_to_send`` (P's live leases: request id -> deadline), read on the writer
            thread with ``in`` only.
        allowed: ``allowed(host) -> bool``: whether P may dial a D side-channel address (P's verdict
            allowlist: :meth:`leasekit.vllm.prefill.replies.VerdictReplies.allowed`).
        hold_s: seconds a registration waits for its lease or address before it is dropped.
        max_bytes: the largest registration accepted (bytes).
        drop: ``drop(reason, agent, detail)``: counts and logs one dropped notification (engine thread).
        clock: seconds, monotonic (``time.perf_counter``).
    """

    def __init__(self, reqs_to_send: Mapping[str, float], *, allowed: Callable[[str], bool], hold_s: float, max_bytes: int,
                 drop: Callable[[str, Any, str], None], clock: Callable[[], float] = time.perf_counter):
        self._reqs_to_send = reqs_to_send
        self._bases: dict[str, str] = {}
        self._drop = drop
        self._clock = clock
        self.guard = PushRegGuard(live=self.live, allowed=allowed, hold_s=hold_s, max_bytes=max_bytes)
        self._forwarded: deque[tuple[str, bytes]] = deque()
        self._dropped: deque[tuple[str, str, str]] = deque()
        self._issued: deque[tuple[str, float, str]] = deque()
        self._agents: dict[str, str] = {}  # lease -> agent of its accepted registration (writer thread writes)
        self._lock = threading.Lock()

    # -- writer thread ---------------------------------------------------------------------------------------
    def live(self, request_id: str) -> str | None:
        """P's lease for a registration's ``request_id``: itself if P holds it, else the live lease with the same
        base id (:func:`base_request_id`); None if neither."""
        if request_id in self._reqs_to_send:
            return request_id
        lease = self._bases.get(base_request_id(request_id))
        return lease if lease is not None and lease in self._reqs_to_send else None

    def writer_batch(self, batch: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """What vLLM's writer thread sees of one NIXL ``get_new_notifs`` batch (agent name -> messages): the
        registrations the guard accepts now (and held ones it accepts now), nothing else. The other
        notifications are kept, with their sender, for :meth:`take_notifications`. Never raises."""
        regs: list[tuple[str, bytes]] = []
        with self._lock:
            for agent, messages in batch.items():
                for msg in messages:
                    if isinstance(msg, (bytes, bytearray)) and bytes(msg[:len(PUSH_REG_PREFIX)]) == PUSH_REG_PREFIX:
                        regs.append((agent, msg))
                    else:
                        self._forwarded.append((agent, msg))
        accepted, dropped = self.guard.filter(regs, self._clock())
        self._dropped.extend(dropped)
        out: dict[str, list[bytes]] = {}
        for agent, msg, _reg, lease in accepted:
            self._agents[lease] = agent
            out.setdefault(agent, []).append(msg)
        return out

    def writer_drop(self, reason: str, agent: str, detail: str) -> None:
        """Queue one registration the writer thread dropped (counted and logged on the engine thread)."""
        self._dropped.append((reason, agent, detail))

    def issued(self, req_id: str, handles: int) -> None:
        """vLLM's writer issued ``handles`` WRITE transfers for lease ``req_id`` (writer thread)."""
        self._issued.append((req_id, self._clock(), self._agents.pop(req_id, "")))

    # -- engine thread ---------------------------------------------------------------------------------------
    def granted(self, req_id: str) -> None:
        """P granted a lease for ``req_id``: registrations naming its base id match it."""
        self._bases[base_request_id(req_id)] = req_id
        if len(self._bases) > 4096 + 4 * len(self._reqs_to_send):  # leases that ended unseen (aborts): prune
            self._bases = {b: r for b, r in self._bases.items() if r in self._reqs_to_send}

    def ended(self, req_id: str) -> None:
        """``req_id``'s lease ended (released, expired or aborted)."""
        base = base_request_id(req_id)
        if self._bases.get(base) == req_id:
            del self._bases[base]
        self._agents.pop(req_id, None)
        self.guard.forget(req_id)

    def take_notifications(self) -> dict[str, list[bytes]]:
        """The non-registration notifications the writer thread saw since the last call, by sender, in order."""
        batch: dict[str, list[bytes]] = {}
        with self._lock:
            while self._forwarded:
                agent, msg = self._forwarded.popleft()
                batch.setdefault(agent, []).append(msg)
        return batch

    def record(self, recorder: Any, stats: Any) -> None:
        """Count and log the registrations the writer thread dropped; note each WRITE issued on its lease span
        (``leasekit.push.write_issued_after_s``: seconds from grant, P's clock; ``leasekit.push.decode_agent``:
        the peer reference of the D agent whose registration it answered) and count it."""
        while self._dropped:
            reason, agent, detail = self._dropped.popleft()
            self._drop(reason, agent, detail)
        while self._issued:
            req_id, at_s, agent = self._issued.popleft()
            granted_at = recorder.grant_time(req_id)
            attributes: dict[str, Any] = {"leasekit.push.write_issued_monotonic_s": at_s}
            if granted_at is not None:
                attributes["leasekit.push.write_issued_after_s"] = at_s - granted_at
            if agent:
                attributes["leasekit.push.decode_agent"] = peer_ref(agent)
            recorder.annotate(req_id, attributes)
            stats.push_write("issued")
