"""The push-mode part of LeaseKit's NIXL worker (:class:`leasekit.vllm.push.LeaseKitPushWorker`), between vLLM's
``nixl-push-writer`` thread and the engine thread. No vLLM import.

In push mode (vllm 0.32.0/0.33.0 ``nixl/push_worker.py``) the writer thread owns NIXL's ``get_new_notifs``: it
acts on ``PUSH_REG`` registrations itself and forwards every other notification, without its sender, to the
engine thread. :class:`PushFlow` takes that batch first (:meth:`PushFlow.writer_batch`, called by the
notification tap on the writer thread): registrations go through :class:`leasekit.lease.pushreg.PushRegGuard`
and only the accepted ones reach vLLM's writer; every other notification is kept *with its sender* for the
engine thread (:meth:`PushFlow.take_notifications`), where P's notification intake binds heartbeats to their D
agent as in pull mode. What the writer thread learns (drops, WRITEs issued) is queued and recorded on the engine
thread (:meth:`PushFlow.record`): spans and metrics are only ever touched there (the writer thread logs only the
lease-end notifications it sends, :mod:`leasekit.vllm.pushend`).

Because the writer thread alone drains NIXL in push mode, P's engine thread knows D's heartbeats only up to the
instant the writer's last forwarded poll began (:attr:`PushFlow.heard_until`); a writer that stalls (a slow WRITE
submission, a blocked NIXL call) silences every D for the engine thread, and vLLM's reap would then expire leases
whose D kept heartbeating. :meth:`PushFlow.reap_clock` is the clock P's reap uses instead: it never concludes a
silence P has not looked at, for at most ``E`` seconds. And :meth:`PushFlow.begin_write` keeps the writer from
submitting a WRITE whose lease was already reaped (its source blocks may have been freed and reused), while
the reap holds back the one lease being submitted (:meth:`PushFlow.reap_hold`).
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from leasekit.lease.pushreg import AMBIGUOUS, PUSH_REG_PREFIX, PushRegGuard
from leasekit.lease.peerref import peer_ref
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger

REAPED_KEPT = 4096
"""How many reaped lease ids :class:`PushFlow` remembers to refuse their WRITEs."""
BACKLOG_MESSAGES = 65536
"""At most this many notifications wait, forwarded by the writer thread, for the engine thread (and at most this
many dropped registrations wait to be logged): past it, while P's engine thread does not take them (a long step,
a stall), a flood from any peer is dropped and counted (``backlog_full``) instead of growing P's memory."""
BACKLOG_BYTES = 64 << 20
"""At most this many bytes of forwarded notifications wait for the engine thread (see :data:`BACKLOG_MESSAGES`)."""
DETAIL_CHARS = 512
"""A queued drop's detail (for its log line) is cut to this many characters: the drop backlog stays a few tens of MB."""
BACKLOG_REASON = "backlog_full"
"""The drop reason of a notification the backlog had no room for."""

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """``request_id`` without vLLM's per-request ``-<8 hex>`` suffix (vllm 0.32.0 ``nixl/utils.py:
    get_base_request_id``, the rule vLLM's push writer matches a registration to P's request by)."""
    return _RANDOM_SUFFIX.sub("", request_id)


@dataclass
class _Registration:
    """What :class:`PushFlow` keeps of one lease's accepted registration (under its lock)."""

    agent: str
    """The D agent whose registration was accepted; "" once the lease's WRITE was issued or the lease ended."""
    end_id: str | None
    """D's request id, to tell D that the lease ended without a WRITE (:mod:`leasekit.lease.pushend`); None when D
    did not ask, or once it was written or told."""
    live: bool = True
    """False once the lease ended: kept only while the writer may still refuse a reaped lease's WRITE and tell D."""


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
        notify_end: ``notify_end(agent, d_request_id)``, called on the writer thread for each registration dropped
            because its lease was already reaped whose D asked to be told (:mod:`leasekit.lease.pushend`); None: nobody
            is told.
        wake: ``wake()`` wakes vLLM's writer thread (its ``_push_writer_wake``). While the guard holds registrations,
            :meth:`writer_batch` arranges a wake once their hold has run out: vLLM's writer polls again only when
            woken (by an engine step) or while it has prefills waiting for a registration, and an idle P steps no
            more, so a held registration would otherwise wait for the next request to be decided.
    """

    def __init__(self, reqs_to_send: Mapping[str, float], *, allowed: Callable[[str], bool], hold_s: float, max_bytes: int,
                 drop: Callable[[str, Any, str], None], clock: Callable[[], float] = time.perf_counter,
                 notify_end: Callable[[str, str], None] | None = None, wake: Callable[[], None] | None = None):
        self._reqs_to_send = reqs_to_send
        self._notify_end = notify_end
        self._wake = wake
        self._wake_timer: threading.Timer | None = None  # writer thread only
        self._bases: dict[str, str] = {}  # base id -> its one live lease, or AMBIGUOUS (read by the writer thread)
        self._clashes: dict[str, set[str]] = {}  # base id -> its live leases while it is AMBIGUOUS (engine thread)
        self._drop = drop
        self._clock = clock
        self.guard = PushRegGuard(live=self.live, allowed=allowed, hold_s=hold_s, max_bytes=max_bytes, reaped=self.was_reaped)
        self._forwarded: deque[tuple[str, bytes]] = deque()
        self._forwarded_bytes = 0
        self._overflow: dict[str, int] = {}  # reason -> messages dropped for want of room (under _lock)
        self._dropped: deque[tuple[str, str, str]] = deque()
        self._issued: deque[tuple[str, float, str]] = deque()
        self._refused: deque[str] = deque()
        self._regs: dict[str, _Registration] = {}  # lease -> its accepted registration (under _lock; pruned)
        self._lock = threading.Lock()
        self._polled_at: float | None = None  # start of the writer's last poll (perf_counter s), under _lock
        self.heard_until: float | None = None
        """Engine thread: every notification NIXL delivered before this instant (perf_counter s) has been taken by
        :meth:`take_notifications`; None before the writer's first poll."""
        self.write_lock = threading.Lock()
        """Held briefly by the reap (engine thread) and by :meth:`begin_write` / :meth:`end_write` (writer thread):
        a lease is never reaped between the writer's check and the end of its WRITE submission."""
        self.submitting: str | None = None
        """The lease whose WRITE the writer is submitting now (the reap holds it back: :meth:`reap_hold`)."""
        self._reaped: dict[str, None] = {}  # leases the reap ended, oldest first (bounded: REAPED_KEPT)
        self._unregistered: dict[str, None] = {}  # of _reaped, those reaped before any registration was accepted
        self._reaped_bases: dict[str, int] = {}  # base id -> how many of _unregistered have it
        self._overflow_warning = RateLimitedWarning(lease_logger())
        self._end_warning = RateLimitedWarning(lease_logger())
        self.lost_at: float | None = None
        """When the writer last dropped a forwarded notification for want of room (perf_counter s), or None."""

    # -- writer thread ---------------------------------------------------------------------------------------
    def live(self, request_id: str) -> str | None:
        """P's lease for a registration's ``request_id``: itself if P holds it, else the live lease with the same
        base id (:func:`base_request_id`); :data:`~leasekit.lease.pushreg.AMBIGUOUS` while more than one lease P
        granted has that base id and any of them is live (vLLM's writer would pick one of them,
        ``push_worker.py`` ``_pop_matching_finished_blocks``); None if none."""
        lease = self._bases.get(base_request_id(request_id))
        if lease == AMBIGUOUS:  # even an exact id: vLLM's writer falls back to any lease of that base id
            return lease
        if request_id in self._reqs_to_send:
            return request_id
        return lease if lease is not None and lease in self._reqs_to_send else None

    def writer_batch(self, batch: dict[str, list[bytes]], polled_at: float | None = None) -> dict[str, list[bytes]]:
        """What vLLM's writer thread sees of one NIXL ``get_new_notifs`` batch (agent name -> messages): the
        registrations the guard accepts now (and held ones it accepts now), nothing else. The other
        notifications are kept, with their sender, for :meth:`take_notifications`. ``polled_at``: when the NIXL
        poll that returned ``batch`` began (perf_counter s; None: not known, :attr:`heard_until` stays). Never
        raises."""
        regs: list[tuple[str, bytes]] = []
        with self._lock:
            for agent, messages in batch.items():
                for msg in messages:
                    if isinstance(msg, (bytes, bytearray)) and bytes(msg[:len(PUSH_REG_PREFIX)]) == PUSH_REG_PREFIX:
                        regs.append((agent, msg))
                        continue
                    size = len(msg) if isinstance(msg, (bytes, bytearray, str)) else 0
                    if len(self._forwarded) >= BACKLOG_MESSAGES or self._forwarded_bytes + size > BACKLOG_BYTES:
                        self._overflow[BACKLOG_REASON] = self._overflow.get(BACKLOG_REASON, 0) + 1
                        self.lost_at = self._clock()
                        continue
                    self._forwarded.append((agent, msg))
                    self._forwarded_bytes += size
            if polled_at is not None:
                self._polled_at = polled_at
        accepted, dropped = self.guard.filter(regs, self._clock())
        self._queue_drops(dropped)
        for agent, d_request_id in self.guard.take_ended():
            if self._notify_end is not None:
                try:  # the accepted registrations below must still reach vLLM's writer
                    self._notify_end(agent, d_request_id)
                except Exception as exc:  # rare (the send itself reports its errors): logged, rate-limited
                    self._end_warning.warn("LeaseKit: could not tell D that its lease ended: %s", repr(exc)[:DETAIL_CHARS],
                                           event="push_end_failed", remote_agent=agent)  # logged as its peer ref
        if self._wake is not None and self.guard.held and (self._wake_timer is None or not self._wake_timer.is_alive()):
            self._wake_timer = threading.Timer(self.guard.hold_s + 0.05, self._wake)  # decide them when their hold ends
            self._wake_timer.daemon = True
            self._wake_timer.start()
        out: dict[str, list[bytes]] = {}
        with self._lock:
            for agent, _msg, reg, lease in accepted:  # before its WRITE can be issued: never told it ended by registration
                old = self._regs.get(lease)
                end_id = reg.request_id if reg.push_end else (old.end_id if old is not None and old.live else None)
                self._regs[lease] = _Registration(agent, end_id)
        for agent, msg, _reg, lease in accepted:
            out.setdefault(agent, []).append(msg)
        return out

    def writer_drop(self, reason: str, agent: str, detail: str) -> None:
        """Queue one registration the writer thread dropped (counted and logged on the engine thread)."""
        self._queue_drops([(reason, agent, detail)])

    def _queue_drops(self, drops: list[tuple[str, str, str]]) -> None:
        """Queue drops to count and log on the engine thread; past :data:`BACKLOG_MESSAGES` waiting, only counted."""
        with self._lock:
            for reason, agent, detail in drops:
                if len(self._dropped) < BACKLOG_MESSAGES:
                    self._dropped.append((reason, agent, detail[:DETAIL_CHARS]))  # bounded bytes, not only messages
                else:
                    self._overflow[reason] = self._overflow.get(reason, 0) + 1

    def begin_write(self, req_id: str) -> bool:
        """Writer thread, before vLLM submits the WRITE of lease ``req_id``: False (submit nothing) once P's reap
        ended it (its source blocks may be freed and reused); else True, and the reap holds the lease back until
        :meth:`end_write`. The lock is held only for this check, never across the submission."""
        with self.write_lock:
            if req_id in self._reaped:
                return False
            self.submitting = req_id
            return True

    def end_write(self) -> None:
        """Writer thread: the submission :meth:`begin_write` allowed is over (submitted or raised)."""
        with self.write_lock:
            self.submitting = None

    def reap_hold(self) -> tuple[str, ...]:
        """Engine thread, with :attr:`write_lock` held by the reap: the lease being submitted, if any (a due lease
        is reaped at the next step, and then its WRITE is in flight: a late write if it finishes after)."""
        return () if self.submitting is None else (self.submitting,)

    def refused(self, req_id: str) -> str | None:
        """The writer did not submit the WRITE of ``req_id``: its lease had been reaped (writer thread). Returns D's
        request id when its registration asked to be told that the lease ended (:mod:`leasekit.lease.pushend`), else
        None."""
        self._refused.append(req_id)
        with self._lock:
            reg = self._regs.get(req_id)
            if reg is None:
                return None
            end_id, reg.end_id = reg.end_id, None
            if not reg.live:
                del self._regs[req_id]
            return end_id

    def was_reaped(self, request_id: str) -> bool:
        """Whether ``request_id`` (or its base id, :func:`base_request_id`) names a lease P's reap ended before any
        registration of it was accepted (among the newest :data:`REAPED_KEPT` reaped): no WRITE of it was ever
        issued, so D may be told it ended. A lease that had one may have a WRITE in flight: only the writer's refusal
        (:meth:`refused`) tells D about it. Writer thread; reads only."""
        return request_id in self._unregistered or base_request_id(request_id) in self._reaped_bases

    def take_refused(self) -> list[str]:
        """The leases whose WRITE the writer refused since the last call (engine thread), oldest first."""
        out: list[str] = []
        while self._refused:
            out.append(self._refused.popleft())
        return out

    def issued(self, req_id: str, handles: int) -> None:
        """vLLM's writer issued ``handles`` WRITE transfers for lease ``req_id`` (writer thread)."""
        with self._lock:  # the engine thread prunes _regs under it
            reg = self._regs.get(req_id)
            agent = ""
            if reg is not None:
                agent, reg.agent, reg.end_id = reg.agent, "", None  # written: no lease end to tell
                if not reg.live:
                    del self._regs[req_id]
        self._issued.append((req_id, self._clock(), agent))

    # -- engine thread ---------------------------------------------------------------------------------------
    def granted(self, req_id: str) -> None:
        """P granted a lease for ``req_id``: registrations naming its base id match it (and a WRITE for it may be
        submitted again, even if an earlier lease with that id was reaped)."""
        base = base_request_id(req_id)
        known = self._bases.get(base)
        if known == AMBIGUOUS:
            self._clashes[base].add(req_id)
        elif known is not None and known != req_id and known in self._reqs_to_send:
            self._clashes[base] = {known, req_id}  # one X-Request-Id twice: until both ended, no registration matches
            self._bases[base] = AMBIGUOUS
        else:
            self._bases[base] = req_id
        if req_id in self._reaped:
            with self.write_lock:
                self._unreap(req_id)
        if len(self._bases) > 4096 + 4 * len(self._reqs_to_send):  # leases that ended unseen (aborts): prune
            live = self._reqs_to_send
            self._clashes = {b: kept for b, m in self._clashes.items() if (kept := {r for r in m if r in live})}
            self._bases = {b: r for b, r in self._bases.items() if r in live or (r == AMBIGUOUS and b in self._clashes)}
        if len(self._regs) > 4096 + 4 * len(self._reqs_to_send):
            with self._lock:  # the writer thread inserts under it; leases that ended unseen (aborts): prune
                for lease in [lease for lease in self._regs if lease not in self._reqs_to_send]:
                    self._end_registration(lease)

    def ended(self, req_id: str) -> None:
        """``req_id``'s lease ended (released, expired or aborted)."""
        base = base_request_id(req_id)
        if self._bases.get(base) == req_id:
            del self._bases[base]
        elif base in self._clashes:
            self._clashes[base].discard(req_id)
            if not self._clashes[base]:
                del self._clashes[base], self._bases[base]
        with self._lock:
            self._end_registration(req_id)  # the reap has looked at it already (reaped() runs before this)
        self.guard.forget(req_id)

    def _end_registration(self, req_id: str) -> None:
        """``req_id``'s lease ended (:attr:`_lock` held): forget its registration, but keep D's request id while a
        reaped lease waits for the writer to refuse its WRITE and tell D."""
        reg = self._regs.get(req_id)
        if reg is None:
            return
        if req_id in self._reaped and reg.end_id is not None:
            reg.agent, reg.live = "", False
        else:
            del self._regs[req_id]

    def reaped(self, req_ids: list[str]) -> None:
        """P's reap expired ``req_ids`` (engine thread, :attr:`write_lock` held): the writer must not WRITE from
        their blocks. The newest :data:`REAPED_KEPT` are remembered (a WRITE comes within seconds of its grant)."""
        reaped = self._reaped
        with self._lock:  # the writer thread marks registered leases under it
            regs = self._regs
            unregistered = [r for r in req_ids if r not in reaped and not (r in regs and regs[r].live)]
            for req_id in req_ids:
                if req_id in regs:
                    regs[req_id].agent = ""  # registered, never written: its WRITE is refused, no agent to note
        for req_id in unregistered:
            base = base_request_id(req_id)
            self._reaped_bases[base] = self._reaped_bases.get(base, 0) + 1
            self._unregistered[req_id] = None
        for req_id in req_ids:
            reaped[req_id] = None
        while len(reaped) > REAPED_KEPT:
            self._unreap(next(iter(reaped)))

    def _unreap(self, req_id: str) -> None:
        """Forget that the reap ended ``req_id`` (:attr:`write_lock` held)."""
        self._reaped.pop(req_id, None)
        if self._unregistered.pop(req_id, False) is None:
            base = base_request_id(req_id)
            left = self._reaped_bases.get(base, 1) - 1
            if left > 0:
                self._reaped_bases[base] = left
            else:
                self._reaped_bases.pop(base, None)

    def reap_clock(self, now: float, patience_s: float) -> float:
        """The instant (perf_counter s) up to which P's reap may judge D's silence: ``now``, but no later than
        :attr:`heard_until` (what the writer thread has not polled yet, P has not heard), and no earlier than
        ``now - patience_s`` (a writer stalled longer delays reclaim by at most ``patience_s``; P passes
        ``E``). Within ``patience_s`` after the writer last lost a notification for want of room (:attr:`lost_at`),
        never later than ``now - patience_s``: a dropped heartbeat delays reclaim by at most ``E``. (A flood that
        fills the backlog for longer than ``E`` can still cost a lease all its heartbeats of that time; each loss
        is counted, ``backlog_full``.) A lease is due when its deadline is at or before this instant."""
        heard = self.heard_until
        clock = now if heard is None or heard >= now else max(heard, now - patience_s)
        if self.lost_at is not None and now - self.lost_at < patience_s:
            clock = min(clock, now - patience_s)  # a heartbeat may be among what was lost: judge E late
        return clock

    def take_notifications(self) -> dict[str, list[bytes]]:
        """The non-registration notifications the writer thread saw since the last call, by sender, in order;
        :attr:`heard_until` becomes the start of the writer's poll that delivered the last of them."""
        batch: dict[str, list[bytes]] = {}
        with self._lock:
            self.heard_until = self._polled_at
            while self._forwarded:
                agent, msg = self._forwarded.popleft()
                batch.setdefault(agent, []).append(msg)
            self._forwarded_bytes = 0
        return batch

    def record(self, recorder: Any, stats: Any) -> None:
        """Count and log the registrations the writer thread dropped (and count, with one rate-limited WARNING, what
        found no room in the backlog: :data:`BACKLOG_MESSAGES`); note each WRITE issued on its lease span
        (``leasekit.push.write_issued_after_s``: seconds from grant, P's clock; ``leasekit.push.decode_agent``:
        the peer reference of the D agent whose registration it answered) and count it."""
        with self._lock:
            overflow, self._overflow = self._overflow, {}
        while self._dropped:
            reason, agent, detail = self._dropped.popleft()
            self._drop(reason, agent, detail)
        for reason, count in sorted(overflow.items()):
            stats.dropped(reason, count)
            self._overflow_warning.warn(
                "LeaseKit: %d notification(s) dropped (%s): P's engine thread had not taken those already waiting "
                "(a long step, a stall, or a flood from a peer)", count, reason,
                event="notification_backlog_full", reason=reason, count=count)
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
