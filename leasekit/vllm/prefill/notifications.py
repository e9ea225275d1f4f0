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
- the LeaseKit protocol (docs/fail-closed.md): hellos, verdicts and heartbeat acknowledgements are
  :class:`leasekit.vllm.prefill.replies.VerdictReplies`; a verdict or acknowledgement arriving as a NIXL
  notification is ``bad_protocol`` (they travel over ZMQ; D's inbox hands them to its read gate,
  :mod:`leasekit.vllm.decode.gate`).

Each drop is one ``leasekit_kv_lease_notifications_dropped_total{reason}`` increment and a WARNING at
most every 10 s (with the suppressed count). An unexpected exception while handling one message drops
that message (``internal_error``) and the rest of the batch is still handled.
"""

from __future__ import annotations

from typing import Any

from leasekit.lease.binding import DUPLICATE, FOREIGN, RELEASED
from leasekit.lease.codec import (
    REASON_BAD_PROTOCOL,
    Ack,
    Completion,
    DecodeError,
    Heartbeat,
    Verdict,
    decode_notification,
    split_protocol_ids,
)
from leasekit.lease.pkeeping import DEFERRED, HELD, NOT_LIVE, PLeaseKeeping
from leasekit.lease.readgate import agent_name
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.prefill.pledges import PledgeHolds
from leasekit.vllm.prefill.replies import VerdictReplies
from leasekit.vllm.prefill.vllmstate import VllmSendState


class PNotificationIntake:
    """P's handling of one worker's NIXL notifications (a component of LeaseKit's P worker; see the
    module docstring for the rules).

    Args:
        state: vLLM's lease state (:class:`leasekit.vllm.prefill.vllmstate.VllmSendState`).
        keeping: P's lease keeping (:class:`leasekit.lease.pkeeping.PLeaseKeeping`): the rules every
            heartbeat and completion is decided by (binding, max hold, pledge); this component mirrors
            each decision into vLLM's maps, the spans, the metrics and the logs.
        pledges: P's pledge holds (early completions, releases deferred to a pledge's end).
        replies: P's verdict channel (hellos, verdicts, acknowledgements).
        recorder: the lease span recorder (``extend``, ``retrieval``, ``release``, ``late_read``, ...).
        stats: the lease stats observer (``dropped``).
        errors: :class:`leasekit.vllm.taps.TelemetryErrors` (telemetry failures, never raised).
        max_bytes: the largest notification handled (bytes).

    Never raises for anything a peer sent.
    """

    def __init__(self, state: VllmSendState, keeping: PLeaseKeeping, pledges: PledgeHolds, replies: VerdictReplies,
                 recorder: Any, stats: Any, errors: Any, *, max_bytes: int):
        self.state, self.keeping, self.pledges, self.replies = state, keeping, pledges, replies
        self.recorder, self.stats, self.errors = recorder, stats, errors
        self.max_bytes, self.max_hold_s = max_bytes, keeping.max_hold_s
        self._drop_warning = RateLimitedWarning(lease_logger())
        self._late_warning = RateLimitedWarning(lease_logger())

    def drain(self, batch: dict[Any, list[Any]], now: float) -> set[str]:
        """Handle one step's notifications (``batch``: NIXL agent name -> raw messages, as
        ``nixl_wrapper.get_new_notifs()`` returns them) at ``now`` (s, read before any handling:
        extensions are never later than stock's), then release the pledged leases whose pledge ended.
        Returns the request ids whose blocks every consumer read (stock ``_get_new_notifs`` contract).
        Never raises: an unexpected error on one message drops that message (``internal_error``)."""
        done: set[str] = set()
        for agent, messages in batch.items():
            heartbeats_seen: set[bytes] = set()
            for raw in messages:
                try:
                    self._notification(agent_name(agent), raw, now, done, heartbeats_seen)
                except Exception as exc:  # a bug of ours must not take P's engine down
                    self.drop("internal_error", agent, f"{type(exc).__name__}: {exc}")
        try:
            self.pledges.release_due(now, done)  # pledged leases whose completion came early
        except Exception as exc:  # a bug of ours must not take P's engine down (the ids go to vLLM first)
            self.pledges.warning.warn("LeaseKit: releasing pledged leases failed: %s: %s", type(exc).__name__,
                                      exc, event="pledge_release_error")
        return done

    def _notification(self, agent: str, raw: Any, now: float, done: set[str], heartbeats_seen: set[bytes]) -> None:
        message = decode_notification(raw, max_bytes=self.max_bytes)
        if isinstance(message, DecodeError):
            self.drop(message.reason, agent, message.detail)
        elif isinstance(message, Heartbeat):
            key = bytes(raw)
            if key in heartbeats_seen:
                self.drop("duplicate", agent, "repeated heartbeat in one batch")
                return
            heartbeats_seen.add(key)
            self.heartbeat(agent, message.req_ids, now)
        elif isinstance(message, Completion):
            self.completion(agent, message, now, done)
        elif isinstance(message, (Verdict, Ack)):  # P -> D messages travel over ZMQ (verdictchan.py)
            self.drop(REASON_BAD_PROTOCOL, agent, "a verdict or ack as a NIXL notification")

    def heartbeat(self, agent: str, req_ids: tuple[str, ...], now: float) -> None:
        """One decoded heartbeat of ``agent`` at ``now`` (s): each id P holds and ``agent`` may extend gets
        ``deadline = max(deadline, min(now + E, grant + max hold))``; a hello or sequence token in it goes
        to the verdict channel. May raise on an internal error (:meth:`drain` catches it per message)."""
        extension = self.state.lease_extension_s
        seq, hello, req_ids = split_protocol_ids(req_ids)
        if hello is not None:
            self.replies.hello(agent, hello)
        acked: list[str] = []
        remaining = float("inf")
        send, keeping = self.state.reqs_to_send, self.keeping
        for req_id in req_ids:
            old = send.get(req_id)
            if old is None:
                continue  # not granted yet, or already ended: D heartbeats until it reads (stock ignores)
            new = keeping.heartbeat(req_id, agent, now, extension)  # binding, then renewal capped by max hold
            if new is None and not keeping.binding.heartbeat(req_id, agent):  # not indexed (cannot happen
                new = FOREIGN  # once granted): the same rules here
            if new is FOREIGN:
                self.drop("foreign_heartbeat", agent, f"request {req_id} is bound to another agent")
                continue
            if new is None or new < old:
                new = max(old, min(now + extension, self._cap(req_id, old)))
            send[req_id] = new
            try:  # telemetry, per id: a failure must not keep the next ids of this heartbeat from renewal
                self.recorder.extend(req_id, new, remote_agent=agent, now=now)
            except Exception as exc:
                self.errors.report("extend", exc)
            acked.append(req_id)
            remaining = min(remaining, new - now)
        if seq is not None:
            self.replies.ack(agent, seq, acked, remaining if acked else 0.0, now)

    def _cap(self, req_id: str, deadline: float) -> float:
        grant = self.recorder.grant_time(req_id)
        return float("inf") if grant is None else max(deadline, grant + self.max_hold_s)

    def completion(self, agent: str, message: Completion, now: float, done: set[str]) -> None:
        """One decoded completion of ``agent`` at ``now`` (s); a request whose last consumer reported goes
        to ``done`` (or waits for its pledge, or for its grant). vLLM's maps are updated before any
        telemetry, so a telemetry failure cannot leave a lease half released. May raise on an internal
        error before the keeping decided (:meth:`drain` catches it per message)."""
        req_id, state = message.req_id, self.state
        granted, prefilled = req_id in state.reqs_to_send, req_id in state.reqs_to_process
        live = granted or prefilled or self.keeping.pledges.holding(req_id)
        self.replies.verdict(agent, req_id, live)  # before anything can raise: D must hear, whatever happens
        result = self.keeping.completion(req_id, agent, message.expected_consumers, now, granted=granted,
                                         prefilled=prefilled)
        if result == HELD:  # completed, still pinned by its pledge
            self.drop("duplicate", agent, f"completion for request {req_id}, already completed")
            return
        if result == NOT_LIVE:
            fail_closed = self.replies.speaks(agent)  # it hears "reaped" and discards the read
            if self.recorder.late_read(req_id, remote_agent=agent, now=now, fail_closed=fail_closed):
                state.record_notification_after_expiry()
                self._late_warning.warn(
                    "LeaseKit: D agent %s finished reading KV blocks of request %s after P ended its lease; "
                    "the blocks may have been freed or reused before the read%s", agent, req_id,
                    " (D speaks the fail-closed protocol: told to discard it)" if fail_closed else "",
                    event="late_read", request_id=req_id, remote_agent=agent, fail_closed=fail_closed,
                )
            else:
                self.drop("unknown_id", agent, f"completion for request {req_id} P never held")
            return
        if result == DUPLICATE:
            self.drop("duplicate", agent, f"second completion for request {req_id}")
            return
        if result == FOREIGN:
            self.drop("foreign_completion", agent, f"request {req_id} is bound to another agent")
            return
        state.consumer_counts[req_id] += 1  # vLLM's side first: the keeping's decision is applied whatever follows
        if result in (RELEASED, DEFERRED):  # EARLY: held until its grant reaches this worker (prefill/pledges.py)
            state.take_out(req_id)
            if result == RELEASED:  # DEFERRED: freed when its pledge ends
                done.add(req_id)
        try:  # telemetry last: a failure here cannot leave the lease half released
            self.recorder.retrieval(req_id, remote_agent=agent, now=now)
            if result == RELEASED:
                self.recorder.release(req_id, now=now)
        except Exception as exc:
            self.errors.report("completion", exc)

    def expiry_cause(self, req_id: str) -> str | None:
        """``max_hold`` when ``req_id``'s deadline sits at its cap, else None (the recorder decides)."""
        grant, deadline = self.recorder.grant_time(req_id), self.recorder.deadline(req_id)
        if grant is None or deadline is None:
            return None
        return ev.CAUSE_MAX_HOLD if deadline >= grant + self.max_hold_s - 1e-6 else None

    def sweep_bindings(self) -> None:
        """Forget bindings of leases that ended (called once per step; O(1) unless there is garbage)."""
        send, process = self.state.reqs_to_send, self.state.reqs_to_process
        binding = self.keeping.binding
        if len(binding) > len(send) + len(process):
            binding.retain(set(send) | set(process))

    def drop(self, reason: str, agent: Any, detail: str) -> None:
        """Count one dropped message (``leasekit_kv_lease_notifications_dropped_total{reason}``) and log it
        (a WARNING at most every 10 s, with the suppressed count)."""
        self.stats.dropped(reason)
        self._drop_warning.warn(
            "LeaseKit: dropped a notification from agent %s (%s: %s)", agent, reason, detail[:200],
            event="notification_dropped", reason=reason, remote_agent=str(agent),
        )
