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

from leasekit.lease.binding import DUPLICATE, FOREIGN, RELEASED, UNPROVEN
from leasekit.lease.codec import (
    REASON_BAD_PROTOCOL,
    Ack,
    Completion,
    DecodeError,
    Verdict,
    decode_notification,
    split_protocol_ids,
)
from leasekit.lease.heartbeat_ids import decode_heartbeat_ids
from leasekit.lease.peerref import peer_ref
from leasekit.lease.pkeeping import CLAIM_WAIT, DEFERRED, HELD, NOT_LIVE, PLeaseKeeping
from leasekit.lease.proof import split_tagged
from leasekit.lease.readgate import agent_name
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.prefill.pledges import PledgeHolds
from leasekit.vllm.prefill.replies import VerdictReplies
from leasekit.vllm.prefill.vllmstate import VllmSendState

HEARTBEAT_BYTES = b"HB:"
BYTES_PER_LIVE_LEASE = 160
"""Heartbeat bytes P accepts per lease id (an id of up to ~140 characters, its tag and a comma)."""
LAGGING_IDS = 65536
"""Ids beyond P's live leases a heartbeat may name: leases D still waits on that P already ended or has not
granted yet. A heartbeat may be ``max(leasekit_max_notification_bytes, (live leases + LAGGING_IDS) *
BYTES_PER_LIVE_LEASE)`` bytes (10 MiB with no live lease), what a stock D naming every lease it waits on in one
message can send (a LeaseKit D splits its heartbeats at 256 KiB)."""


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
        extensions are never later than stock's), then the plain completions whose claim window ended, then
        release the pledged leases whose pledge ended. Returns the request ids whose blocks every consumer read
        (stock ``_get_new_notifs`` contract). Never raises: an unexpected error on one message drops that
        message (``internal_error``)."""
        done: set[str] = set()
        keeping = self.keeping
        voided = keeping.voided
        for agent, messages in batch.items():
            heartbeats_seen: set[bytes] = set()
            for raw in messages:
                try:
                    self._notification(agent_name(agent), raw, now, done, heartbeats_seen)
                except Exception as exc:  # a bug of ours must not take P's engine down
                    self.drop("internal_error", agent, f"{type(exc).__name__}: {exc}")
        if keeping.held_plain:
            for req_id, agent, n in keeping.due_plain(now):
                try:
                    self.completion(agent, Completion(req_id, n), now, done)
                except Exception as exc:
                    self.drop("internal_error", agent, f"{type(exc).__name__}: {exc}")
        for _ in range(keeping.voided - voided):
            self.drop("unproven_completion", "?", "a plain completion held in its claim window; the lease was "
                      "then proven (or ended) first")
        try:
            self.pledges.release_due(now, done)  # pledged leases whose completion came early
        except Exception as exc:  # a bug of ours must not take P's engine down (the ids go to vLLM first)
            self.pledges.warning.warn("LeaseKit: releasing pledged leases failed: %s: %s", type(exc).__name__,
                                      exc, event="pledge_release_error")
        return done

    def _notification(self, agent: str, raw: Any, now: float, done: set[str], heartbeats_seen: set[bytes]) -> None:
        if isinstance(raw, (bytes, bytearray)) and raw.startswith(HEARTBEAT_BYTES):
            parsed = decode_heartbeat_ids(raw, max_bytes=self.heartbeat_max_bytes())
            if isinstance(parsed, DecodeError):
                self.drop(parsed.reason, agent, parsed.detail)
                return
            ids, junk = parsed
            if junk:  # counted whatever follows: each junk id is dropped alone
                self.stats.dropped("bad_heartbeat_id", junk)
            key = bytes(raw)
            if key in heartbeats_seen:
                self.drop("duplicate", agent, "repeated heartbeat in one batch")
                return
            heartbeats_seen.add(key)
            self.heartbeat(agent, ids, now)
            return
        message = decode_notification(raw, max_bytes=self.max_bytes)
        if isinstance(message, DecodeError):
            self.drop(message.reason, agent, message.detail)
        elif isinstance(message, Completion):
            self.completion(agent, message, now, done)
        elif isinstance(message, (Verdict, Ack)):  # P -> D messages travel over ZMQ (verdictchan.py)
            self.drop(REASON_BAD_PROTOCOL, agent, "a verdict or ack as a NIXL notification")
        else:  # a heartbeat that is not bytes (a memoryview): handled as any other
            self.heartbeat(agent, message.req_ids, now)

    def heartbeat_max_bytes(self) -> int:
        """The largest heartbeat P reads now, bytes: ``max(max_bytes, (live leases +`` :data:`LAGGING_IDS` ``) *``
        :data:`BYTES_PER_LIVE_LEASE` ``)``."""
        live = len(self.state.reqs_to_send)
        return max(self.max_bytes, (live + LAGGING_IDS) * BYTES_PER_LIVE_LEASE)

    def heartbeat(self, agent: str, req_ids: tuple[str, ...], now: float) -> None:
        """One decoded heartbeat of ``agent`` at ``now`` (s): each id P holds and may extend on this message's
        word (tagged ``<id>~<tag>`` with the lease's heartbeat tag, or plain for a plain-bound lease) gets
        ``deadline = max(deadline, min(now + E, grant + max hold))``; ids P does not hold are counted
        (``leasekit_kv_lease_heartbeat_unknown_ids_total``); a hello or sequence token in it goes to the
        verdict channel. May raise on an internal error (:meth:`drain` catches it per message)."""
        extension = self.state.lease_extension_s
        seq, hello, req_ids = split_protocol_ids(req_ids)
        if hello is not None:
            self.replies.hello(agent, hello)
        acked: list[str] = []
        remaining = float("inf")
        unknown = 0
        send, keeping = self.state.reqs_to_send, self.keeping
        for wire_id in req_ids:
            req_id, tag = wire_id, None
            old = send.get(wire_id)
            if old is None:
                split = split_tagged(wire_id)
                if split is None or (old := send.get(split[0])) is None:
                    unknown += 1  # not granted yet, or ended: D heartbeats until it reads (stock ignores)
                    continue
                req_id, tag = split
            new = keeping.heartbeat(req_id, agent, now, extension, tag)  # proof or binding, then renewal
            if new is None:  # not indexed (cannot happen once granted): plain-bound rules here
                new = FOREIGN if tag is not None or keeping.binding.heartbeat(req_id, agent) is not True else None
            if new is CLAIM_WAIT:
                continue  # a plain first contact inside the claim window: no effect (the deadline could not move)
            if new is FOREIGN or new is UNPROVEN:
                self.drop("foreign_heartbeat" if new is FOREIGN else "unproven_heartbeat", agent,
                          f"request {req_id}: " + ("bound to another agent" if new is FOREIGN else "no valid proof"))
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
        if unknown:
            self.stats.heartbeat_unknown_ids(unknown)
        if seq is not None and (acked or keeping.proofs.key is None):  # a heartbeat that extended nothing is
            self.replies.ack(agent, seq, acked, remaining if acked else 0.0, now)  # not answered (no amplifier)

    def _cap(self, req_id: str, deadline: float) -> float:
        grant = self.recorder.grant_time(req_id)
        return float("inf") if grant is None else max(deadline, grant + self.max_hold_s)

    def completion(self, agent: str, message: Completion, now: float, done: set[str]) -> None:
        """One decoded completion of ``agent`` at ``now`` (s), plain ``<id>:<n>`` or tagged ``<id>~<tag>:<n>``; a
        request whose last consumer reported goes to ``done`` (or waits for its pledge, for its grant, or, plain
        in its claim window, for the window's end). Only a tagged completion whose tag verifies is answered with
        a verdict. vLLM's maps are updated before any telemetry, so a telemetry failure cannot leave a lease
        half released. May raise on an internal error before the keeping decided (:meth:`drain` catches it)."""
        state, keeping = self.state, self.keeping
        req_id, tag = message.req_id, None
        granted, prefilled = req_id in state.reqs_to_send, req_id in state.reqs_to_process
        if not (granted or prefilled or keeping.pledges.holding(req_id)):
            split = split_tagged(req_id)
            if split is not None:
                req_id, tag = split
                granted, prefilled = req_id in state.reqs_to_send, req_id in state.reqs_to_process
        if tag is not None and not keeping.proofs.completion_ok(req_id, message.expected_consumers, tag):
            self.drop("unproven_completion", agent, f"completion for request {req_id}: no valid proof")
            return
        if tag is not None or keeping.proofs.key is None:  # a P that mints no secrets answers plain ones (legacy)
            live = granted or prefilled or keeping.pledges.holding(req_id)
            self.replies.verdict(agent, req_id, live)  # before anything can raise: D must hear, whatever happens
        result = keeping.completion(req_id, agent, message.expected_consumers, now, granted=granted,
                                    prefilled=prefilled, tag=tag, verified=True)
        if result == CLAIM_WAIT:  # held until the lease's claim window ends (due_plain, in drain)
            return
        if result == HELD:  # completed, still pinned by its pledge
            self.drop("duplicate", agent, f"completion for request {req_id}, already completed")
            return
        if result == NOT_LIVE:
            fail_closed = (tag is not None or keeping.proofs.key is None) and self.replies.speaks(agent)  # told "reaped"
            if self.recorder.late_read(req_id, remote_agent=agent, now=now, fail_closed=fail_closed):
                state.record_notification_after_expiry()
                self._late_warning.warn(
                    "LeaseKit: D agent %s finished reading KV blocks of request %s after P ended its lease; "
                    "the blocks may have been freed or reused before the read%s", peer_ref(agent), req_id,
                    " (D speaks the fail-closed protocol: told to discard it)" if fail_closed else "",
                    event="late_read", request_id=req_id, remote_agent=peer_ref(agent), fail_closed=fail_closed,
                )
            else:
                self.drop("unknown_id", agent, f"completion for request {req_id} P never held")
            return
        if result == DUPLICATE:
            self.drop("duplicate", agent, f"second completion for request {req_id}")
            return
        if result == FOREIGN or result == UNPROVEN:
            self.drop("foreign_completion" if result == FOREIGN else "unproven_completion", agent,
                      f"request {req_id}: " + ("bound to another agent" if result == FOREIGN else "no valid proof"))
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
        ref = peer_ref(agent)
        self._drop_warning.warn(
            "LeaseKit: dropped a notification from agent %s (%s: %s)", ref, reason, detail[:200],
            event="notification_dropped", reason=reason, remote_agent=ref,
        )
