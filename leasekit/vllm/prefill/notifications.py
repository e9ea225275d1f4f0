"""P's handling of D's NIXL notifications in LeaseKitConnector: parsed by leasekit's codecs, bound to
the right peer, capped in total life, and never able to raise out of the engine loop.

Replaces vllm 0.32.0 ``nixl/pull_worker.py: _get_new_notifs`` and ``nixl/base_worker.py:
_handle_heartbeat`` for the P worker. Stock behaviour it keeps for every well-formed message from the
right peer: a heartbeat sets ``deadline = max(deadline, now + E)``; a completion ``"<id>:<n>"`` for a
request in ``_reqs_to_send``/``_reqs_to_process`` counts one consumer, and the blocks are freed when
``n`` consumers reported. What it changes:

- every message goes through :func:`leasekit.lease.codec.decode_notification` (size checked before
  decoding; default ceiling 1 MiB, ``kv_connector_extra_config.leasekit_max_notification_bytes``);
  non-UTF-8, no colon, bad count, oversized, empty or bad ids are dropped and counted by reason
  (stock raises inside P's engine step: the engine dies and every other message of the batch is lost);
- :class:`leasekit.lease.binding.LeaseBinding`: heartbeats and completions from an agent the lease is
  not bound to are dropped (``foreign_*``), repeats from one agent are ``duplicate``;
- a completion for a request P never held is ``unknown_id`` (stock counts it as a late read); one for a
  lease that already ended is a late read (span, metric, rate-limited WARNING, vLLM's
  ``notifications_after_expiry`` counter);
- max hold: no heartbeat extends a lease past ``grant + max_hold_s`` (default max(480 s, L),
  ``leasekit_max_hold_s``); such a lease expires with cause ``max_hold``;
- the LeaseKit protocol (docs/fail-closed.md): a hello (the heartbeat id ``LK1~H~<base64 endpoint and
  token>``) from a D agent names the ZMQ endpoint of that D worker's verdict inbox and its token (:mod:`leasekit.vllm.verdictchan`;
  a bad one is dropped as ``bad_hello``, a later one replaces it; at most 1024 D agents are kept, the least
  recently used closed first) so P can answer it without a NIXL (UCX) connection back to D; every completion from such an agent is answered
  with a verdict ``LK1:V:ok|reaped:<id>`` (``ok`` iff the lease was live when P handled it); ``ok``
  verdicts for an agent whose hello has not arrived yet are kept (bounded) and sent when it does. Every heartbeat
  from such an agent that carries D's sequence token ``LK1~<n>`` is acknowledged,
  ``LK1:A:<n>:<remaining ms>:<ids>`` (the ids it extended and the least time left over them, counted from
  ``now``, read before the batch was handled; at most 60 KiB of ids). A verdict or acknowledgement arriving as a NIXL notification is
  ``bad_protocol`` (they travel over ZMQ; D's inbox hands them to its read gate, :mod:`leasekit.vllm.decode.gate`).

Each drop is one ``leasekit_kv_lease_notifications_dropped_total{reason}`` increment and a WARNING at
most every 10 s (with the suppressed count). An unexpected exception while handling one message drops
that message (``internal_error``) and the rest of the batch is still handled.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from leasekit.lease.binding import DUPLICATE, FOREIGN, RELEASED, LeaseBinding
from leasekit.lease.codec import (
    REASON_BAD_PROTOCOL,
    Ack,
    Completion,
    DecodeError,
    MAX_HEARTBEAT_ID_CHARS,
    Heartbeat,
    Verdict,
    decode_notification,
    encode_ack,
    encode_verdict,
    split_protocol_ids,
)
from leasekit.lease.config import LeaseTiming
from leasekit.lease.readgate import agent_name
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.prefill.pledges import PPledgeHolds
from leasekit.vllm.prefill.expiry import ExpiryIndex
from leasekit.vllm.verdictchan import MAX_ACK_BYTES, VerdictOutbox, decode_hello_payload

MAX_PENDING_VERDICTS_PER_AGENT = 256
"""Verdicts kept for one D agent whose hello has not arrived (the oldest go first)."""
MAX_PENDING_AGENTS = 64
"""Agents with kept verdicts (stock D agents never say hello; the oldest agent's are dropped first)."""
MAX_PROTOCOL_AGENTS = 1024
"""D agents P keeps from hellos (each holds a ZMQ socket, one TCP connection); beyond it the least recently
answered is closed (its D says hello again after one read times out)."""




class PNotificationHandling(PPledgeHolds):
    """Mixin for LeaseKitConnector's NIXL worker (needs vLLM's ``_reqs_to_send``, ``_reqs_to_process``,
    ``_lease_extension``, ``consumer_notification_counts_by_req``, ``xfer_stats``, ``nixl_wrapper`` and
    LeaseKit's ``_lk`` span recorder and ``_lk_stats``). Call :meth:`_lk_init_notifications` in
    ``__init__`` after those exist."""

    _lk_ready = True  # its init ran (LeaseKitPullWorker, whose class default is False, sets it after _lk_setup)

    def _lk_init_notifications(self, max_hold_s: float, max_bytes: int, *, fail_closed: bool,
                               pledge_s: float = 0.0, timing: LeaseTiming | None = None) -> None:
        """``max_hold_s``: seconds (see :func:`notification_settings`); ``max_bytes``: the largest
        notification handled; ``fail_closed``: this P speaks the fail-closed protocol
        (``leasekit_fail_closed``); when False hellos are ignored, as a stock P does, and P never
        connects to a D nor answers one (no verdicts, no acknowledgements); ``pledge_s``: P's
        ``leasekit_pledge_s``, seconds (0: no pledge; leasekit/vllm/prefill/pledges.py); ``timing``: the lease
        timing in force (default: the span recorder's), for :attr:`_lk_leases`, the expiry heap that
        indexes vLLM's ``_reqs_to_send`` (:class:`leasekit.vllm.prefill.expiry.ExpiryIndex`)."""
        self._lk_leases = ExpiryIndex(self._reqs_to_send, timing or self._lk.timing, max_hold_s)
        self._lk_fail_closed = fail_closed
        self._lk_init_pledges(pledge_s if fail_closed else 0.0)
        self._lk_pledge_warning = RateLimitedWarning(lease_logger())
        self._lk_binding = LeaseBinding()
        self._lk_max_hold_s = max_hold_s
        self._lk_max_bytes = max_bytes
        self._lk_drop_warning = RateLimitedWarning(lease_logger())
        self._lk_late_warning = RateLimitedWarning(lease_logger())
        self._lk_verdict_warning = RateLimitedWarning(lease_logger())
        self._lk_protocol_agents: dict[str, None] = {}  # insertion-ordered set
        self._lk_pending_verdicts: dict[str, deque[bytes]] = {}
        self._lk_outbox: VerdictOutbox | None = None  # made at the first hello

    def _lk_close_notifications(self) -> None:
        """Close every verdict socket (worker shutdown)."""
        if self._lk_outbox is not None:
            self._lk_outbox.close()

    def _get_new_notifs(self) -> set[str]:
        """Drain NIXL notifications (see module docstring); returns the request ids whose blocks every
        consumer read (stock contract). Never raises for anything a peer sent."""
        if not self._lk_ready:
            return super()._get_new_notifs()
        done: set[str] = set()
        batch = self.nixl_wrapper.get_new_notifs()
        now = time.perf_counter()  # before any handling: extensions are never later than stock's
        for agent, messages in batch.items():
            heartbeats_seen: set[bytes] = set()
            for raw in messages:
                try:
                    self._lk_notification(agent_name(agent), raw, now, done, heartbeats_seen)
                except Exception as exc:  # a bug of ours must not take P's engine down
                    self._lk_drop("internal_error", agent, f"{type(exc).__name__}: {exc}")
        try:
            self._lk_release_deferred(now, done)  # pledged leases whose completion came early (prefill/pledges.py)
        except Exception as exc:  # a bug of ours must not take P's engine down (the ids go to vLLM first)
            self._lk_pledge_warning.warn("LeaseKit: releasing pledged leases failed: %s: %s", type(exc).__name__,
                                         exc, event="pledge_release_error")
        return done

    def _lk_notification(self, agent: str, raw: Any, now: float, done: set[str], heartbeats_seen: set[bytes]) -> None:
        message = decode_notification(raw, max_bytes=self._lk_max_bytes)
        if isinstance(message, DecodeError):
            self._lk_drop(message.reason, agent, message.detail)
        elif isinstance(message, Heartbeat):
            key = bytes(raw)
            if key in heartbeats_seen:
                self._lk_drop("duplicate", agent, "repeated heartbeat in one batch")
                return
            heartbeats_seen.add(key)
            self._lk_heartbeat(agent, message.req_ids, now)
        elif isinstance(message, Completion):
            self._lk_completion(agent, message, now, done)
        elif isinstance(message, (Verdict, Ack)):  # P -> D messages travel over ZMQ (verdictchan.py)
            self._lk_drop(REASON_BAD_PROTOCOL, agent, "a verdict or ack as a NIXL notification")

    def _lk_hello(self, agent: str, payload: bytes) -> None:
        """A D agent's hello: connect (again) to the inbox endpoint it names, with its token, and flush the
        verdicts kept for it. A bad payload or a refused connect is ``bad_hello``."""
        parsed = decode_hello_payload(payload)
        if isinstance(parsed, str):
            self._lk_drop("bad_hello", agent, parsed)
            return
        endpoint, token = parsed
        if self._lk_outbox is None:
            self._lk_outbox = VerdictOutbox(agent_name(self.nixl_wrapper.name))
        if agent in self._lk_protocol_agents:
            del self._lk_protocol_agents[agent]  # most recently used last
        elif len(self._lk_protocol_agents) >= MAX_PROTOCOL_AGENTS:  # least recently used: its D, if alive,
            # times out one read and then says hello again (decode/gate.py)
            self._lk_unload(next(iter(self._lk_protocol_agents)))
        try:
            changed = self._lk_outbox.connect(agent, endpoint, token)
        except Exception as exc:
            self._lk_drop("bad_hello", agent, f"cannot connect to {endpoint}: {type(exc).__name__}: {exc}")
            self._lk_unload(agent)  # its old socket too: the agent is no longer answered
            return
        self._lk_protocol_agents[agent] = None
        if changed:
            lease_logger().info("LeaseKit: D agent %s speaks the fail-closed protocol; its verdicts go to %s",
                                agent, endpoint)
        for msg in self._lk_pending_verdicts.pop(agent, ()):
            self._lk_send_verdict_bytes(agent, msg)

    def _lk_unload(self, name: str) -> None:
        """Forget D agent ``name``: close its socket, drop the verdicts kept for it."""
        self._lk_protocol_agents.pop(name, None)
        self._lk_pending_verdicts.pop(name, None)
        if self._lk_outbox is not None:
            self._lk_outbox.remove(name)

    def _lk_verdict(self, agent: str, req_id: str, ok: bool) -> None:
        """Answer one completion (see module docstring); keep it if the agent's hello is still due.
        Nothing when this P does not speak the protocol."""
        if not self._lk_fail_closed:
            return
        if agent in self._lk_protocol_agents:
            del self._lk_protocol_agents[agent]  # most recently used last: the cap closes idle agents first
            self._lk_protocol_agents[agent] = None
            self._lk_send_verdict_bytes(agent, encode_verdict(req_id, ok))
            return
        if not ok or len(req_id) > MAX_HEARTBEAT_ID_CHARS:
            return  # only a live lease's verdict is kept for a hello still due (a stock D never says one)
        msg = encode_verdict(req_id, ok)
        pending = self._lk_pending_verdicts.get(agent)
        if pending is None:
            if len(self._lk_pending_verdicts) >= MAX_PENDING_AGENTS:
                del self._lk_pending_verdicts[next(iter(self._lk_pending_verdicts))]
            pending = self._lk_pending_verdicts[agent] = deque(maxlen=MAX_PENDING_VERDICTS_PER_AGENT)
        pending.append(msg)

    def _lk_send_verdict_bytes(self, agent: str, msg: bytes, *, ack: bool = False) -> None:
        """Send a verdict (or, with ``ack``, a heartbeat acknowledgement) to a D agent; a failed verdict
        is counted and logged (rate-limited), a failed acknowledgement is not: it only costs D its fast
        path, and D's own heartbeat-failure accounting sees the broken link."""
        try:
            self._lk_outbox.send(agent, msg)  # only agents that said hello are sent to (an outbox exists)
        except Exception as exc:  # D then times out and discards the read: safe, and logged here
            if ack:
                return
            self._lk_stats.verdict_send_failed()
            self._lk_verdict_warning.warn(
                "LeaseKit: could not send a read verdict to D agent %s (%s: %s); D will discard that read "
                "after its verdict timeout", agent, type(exc).__name__, exc,
                event="verdict_send_failure", remote_agent=agent,
            )

    def _lk_heartbeat(self, agent: str, req_ids: tuple[str, ...], now: float) -> None:
        extension = self._lease_extension
        seq, hello, req_ids = split_protocol_ids(req_ids)
        if hello is not None and self._lk_fail_closed:
            self._lk_hello(agent, hello)
        acked: list[str] = []
        remaining = float("inf")
        leases = self._lk_leases
        for req_id in req_ids:
            old = self._reqs_to_send.get(req_id)
            if old is None:
                continue  # not granted yet, or already ended: D heartbeats until it reads (stock ignores)
            lease = leases.get(req_id)
            if lease is not None:
                req_id = lease.req_id  # the granted id object, not the one parsed from this message
            if not self._lk_binding.heartbeat(req_id, agent):
                self._lk_drop("foreign_heartbeat", agent, f"request {req_id} is bound to another agent")
                continue
            new = self._lk_leases.renew(req_id, now, extension)  # the heap's lease (cap: max hold)
            if new is None or new < old:  # not indexed yet (cannot happen once granted): the same rule here
                new = max(old, min(now + extension, self._lk_cap(req_id, old)))
            self._reqs_to_send[req_id] = new
            try:  # telemetry, per id: a failure must not keep the next ids of this heartbeat from renewal
                self._lk.extend(req_id, new, remote_agent=agent, now=now)
            except Exception as exc:
                self._lk_errors.report("extend", exc)
            acked.append(req_id)
            remaining = min(remaining, new - now)
        if seq is not None and agent in self._lk_protocol_agents:
            size, named = 0, []
            for req_id in acked:  # cut to MAX_ACK_BYTES: an ack naming fewer leases is still true
                size += len(req_id.encode()) + 1
                if size > MAX_ACK_BYTES:
                    break
                named.append(req_id)
            self._lk_send_verdict_bytes(agent, encode_ack(seq, remaining if acked else 0.0, named, now, self._lk_clock_id),
                                        ack=True)

    def _lk_cap(self, req_id: str, deadline: float) -> float:
        grant = self._lk.grant_time(req_id)
        return float("inf") if grant is None else max(deadline, grant + self._lk_max_hold_s)

    def _lk_completion(self, agent: str, message: Completion, now: float, done: set[str]) -> None:
        req_id = message.req_id
        deferred = req_id in self._lk_deferred or req_id in self._lk_early  # completed, still pinned (prefill/pledges.py)
        live = deferred or req_id in self._reqs_to_send or req_id in self._reqs_to_process
        self._lk_verdict(agent, req_id, live)  # before anything can raise: D must hear, whatever happens
        if deferred:
            self._lk_drop("duplicate", agent, f"completion for request {req_id}, already completed")
            return
        if not live:
            fail_closed = agent in self._lk_protocol_agents  # it hears "reaped" and discards the read
            if self._lk.late_read(req_id, remote_agent=agent, now=now, fail_closed=fail_closed):
                self.xfer_stats.record_notification_after_expiry()
                self._lk_late_warning.warn(
                    "LeaseKit: D agent %s finished reading KV blocks of request %s after P ended its lease; "
                    "the blocks may have been freed or reused before the read%s", agent, req_id,
                    " (D speaks the fail-closed protocol: told to discard it)" if fail_closed else "",
                    event="late_read", request_id=req_id, remote_agent=agent, fail_closed=fail_closed,
                )
            else:
                self._lk_drop("unknown_id", agent, f"completion for request {req_id} P never held")
            return
        result = self._lk_binding.completion(req_id, agent, message.expected_consumers)
        if result == DUPLICATE:
            self._lk_drop("duplicate", agent, f"second completion for request {req_id}")
            return
        if result == FOREIGN:
            self._lk_drop("foreign_completion", agent, f"request {req_id} is bound to another agent")
            return
        self._lk.retrieval(req_id, remote_agent=agent, now=now)
        self.consumer_notification_counts_by_req[req_id] += 1
        if result == RELEASED:
            if req_id not in self._reqs_to_send:  # before its grant reached this worker: held (prefill/pledges.py)
                self._lk_park_early(req_id, now)
                return
            self._lk_take_out(req_id)
            if not self._lk_defer_release(req_id, now):  # else freed when its pledge ends
                done.add(req_id)
                self._lk.release(req_id, now=now)

    def _lk_expiry_cause(self, req_id: str) -> str | None:
        """``max_hold`` when ``req_id``'s deadline sits at its cap, else None (the recorder decides)."""
        grant, deadline = self._lk.grant_time(req_id), self._lk.deadline(req_id)
        if grant is None or deadline is None:
            return None
        return ev.CAUSE_MAX_HOLD if deadline >= grant + self._lk_max_hold_s - 1e-6 else None

    def _lk_sweep_bindings(self) -> None:
        """Forget bindings of leases that ended (called once per step; O(1) unless there is garbage)."""
        if len(self._lk_binding) > len(self._reqs_to_send) + len(self._reqs_to_process):
            self._lk_binding.retain(set(self._reqs_to_send) | set(self._reqs_to_process))

    def _lk_drop(self, reason: str, agent: Any, detail: str) -> None:
        self._lk_stats.dropped(reason)
        self._lk_drop_warning.warn(
            "LeaseKit: dropped a notification from agent %s (%s: %s)", agent, reason, detail[:200],
            event="notification_dropped", reason=reason, remote_agent=str(agent),
        )
