"""LeaseKitPushConnector: vLLM's push-mode NixlPushConnector (P WRITEs the KV blocks into D once D registers)
with the same lease spans, metrics (``mode="push"``) and logs as LeaseKitConnector, and P's registration guard.

Wire-compatible with stock push peers both ways: it sends and accepts what NixlPushConnector does
(``PUSH_REG:`` + msgpack registrations, ``HB:`` heartbeats, the WRITE's ``"{id}:{n}"`` notification) and keeps
vLLM's compatibility hash (its ``_TRANSFER_MODE`` stays ``"push"``). Hooks of vllm 0.32.0 and 0.33.0
``.../kv_connector/v1/nixl/push_worker.py`` and ``push_scheduler.py`` (recorded per release in
:mod:`leasekit.vllm.needs`):

- P, grant: new ``_reqs_to_send`` entries after ``start_load_kv`` (as in pull mode);
- P, registration: ``get_new_notifs``, which vLLM's ``nixl-push-writer`` thread owns, goes through the notification
  tap and :class:`leasekit.vllm.pushflow.PushFlow`: a ``PUSH_REG`` reaches vLLM's writer only when it is well formed,
  names a lease P holds, names an allowed D address and is the lease's first
  (:mod:`leasekit.lease.pushreg`; otherwise counted in ``leasekit_kv_lease_notifications_dropped_total{reason}``);
- P, WRITE issued: ``_xfer_blocks_for_req`` (writer thread) -> ``leasekit.push.write_issued_*`` on the lease span;
  the WRITE of a lease P's reap already ended is refused (``outcome="refused"``: its blocks may be reused), and a
  LeaseKit D that asked is told the lease ended, as is one that registers for such a lease
  (:mod:`leasekit.vllm.pushend`): D recomputes instead of waiting for ever;
- P, a stalled writer thread: the writer alone drains NIXL in push mode, so P's reap judges D's silence only up to
  the writer's last poll, waiting at most ``E`` for it (:meth:`leasekit.vllm.pushflow.PushFlow.reap_clock`):
  a writer stall does not expire the leases of a D that kept heartbeating;
- P, WRITE done: vLLM reports the lease in ``finished_sending`` -> the lease is released; a WRITE that finished
  after its lease expired (P had freed, maybe reused, the source blocks) is a late write
  (``kv_lease_late_write`` span, ``leasekit_kv_lease_push_writes_total{outcome="late"}``, a WARNING);
- P, heartbeats: the engine thread hands the writer's other notifications, with their sender, to P's notification
  intake (binding, max hold, malformed and foreign messages dropped, as in pull mode); a read completion sent to a
  push P is dropped (``push_completion``): P frees only on its own WRITE handles, as vllm 0.33.0 does;
- P, expiry: vLLM's reap through the expiry heap (:class:`leasekit.vllm.prefill.hooks.PHooks`);
- D, registration (D TP = 1): a request D fell silent on for about ``E - H/2`` or longer is never registered; its
  load is failed for vLLM's ``kv_load_failure_policy`` instead of waiting for a WRITE that may never come;
- D: heartbeat spans as in pull mode; a WRITE notification for a request D no longer waits on (its blocks may have
  been freed and reused) is counted (``leasekit_kv_lease_push_late_writes_total``), logged and dropped; a
  malformed one is counted and dropped instead of raising in D's engine step; one from an agent that is not one of
  the request's P engine, or a repeat from the same agent, is dropped (``foreign_write``, ``duplicate_write``:
  :mod:`leasekit.vllm.decode.writenotes`) instead of counting towards the request's KV.

Load with ``kv_connector="LeaseKitPushConnector"`` and ``kv_connector_module_path="leasekit.vllm.connector"``
(this module is imported by it, after the release check). Configuration: as LeaseKitConnector
(:mod:`leasekit.vllm.connector`), less the fail-closed settings (D reads nothing in push mode).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPushConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from leasekit.lease.bounds import silence_may_expire
from leasekit.lease.codec import Completion, decode_notification
from leasekit.lease.config import LeaseTiming
from leasekit.lease.peerref import peer_ref
from leasekit.lease.pushend import is_push_end
from leasekit.lease.readgate import OUTCOME_PUSHED
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.decode.hooks import DHooks
from leasekit.vllm.decode.writenotes import FOREIGN_WRITE, WriteNoteGuard
from leasekit.vllm.prefill.hooks import PHooks
from leasekit.vllm.pushend import PushEndHooks
from leasekit.vllm.pushflow import PushFlow
from leasekit.vllm.scheduler import LeaseKitSchedulerMixin
from leasekit.vllm.connstats import LeaseKitConnectorStatsMixin
from leasekit.vllm.taps import HEARTBEAT_PREFIX, PushNotificationTap
from leasekit.vllm.worker import LeaseKitWorkerMixin

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

from leasekit.vllm import PUSH_CONNECTOR_NAME  # noqa: E402  (re-exported)


MIN_HOLD_S = 2.0
"""Shortest wait, in seconds, of a registration for its lease or address before P drops it (at small L, H is
shorter than a loaded P's engine step)."""


class LeaseKitPushScheduler(LeaseKitSchedulerMixin, NixlPushConnectorScheduler):
    """The scheduler side of :class:`LeaseKitPushConnector`: vLLM's push scheduler with LeaseKit's part
    (:class:`leasekit.vllm.scheduler.LeaseKitSchedulerMixin`: block counts and trace headers of each lease, D's
    heartbeat tracking, the robust handshake listener; no fail-closed marker and no lease secret)."""

    _lk_mode = "push"


class LeaseKitPushWorker(LeaseKitWorkerMixin, PushEndHooks, PHooks, DHooks, NixlPushConnectorWorker):
    """The worker side of :class:`LeaseKitPushConnector` (see the module docstring for what each hook does).

    Built without ``__init__`` (``_lk_ready`` False), every method is vLLM's."""

    _lk_mode = "push"
    _lk_tap_class = PushNotificationTap

    def _lk_setup_mode(self, timing: LeaseTiming, max_bytes: int) -> None:
        """The registration guard and the writer/engine-thread flow (:class:`leasekit.vllm.pushflow.PushFlow`),
        attached to the notification tap; a registration waits at most ``max(H, MIN_HOLD_S)`` seconds for its lease
        or its address (the grant and the side-channel peer reach the worker one engine step after they happen)."""
        self._lk_flow = PushFlow(self._reqs_to_send, allowed=self._lk_p.replies.allowed,
                                 hold_s=max(timing.heartbeat_interval_s, MIN_HOLD_S), max_bytes=max_bytes,
                                 drop=self._lk_p.intake.drop, notify_end=self._lk_end_to_agent,
                                 wake=self._push_writer_wake.set)
        self._lk_tap.flow = self._lk_flow
        self._lk_gate.unmarked_outcome = OUTCOME_PUSHED  # D reads nothing: a WRITE received is not a stock read
        self._lk_late: list[str] = []
        self._lk_failed: list[str] = []
        self._lk_failing: set[str] = set()  # leases whose WRITE failed and still has handles out (counted once)
        self._lk_late_warning = RateLimitedWarning(lease_logger())
        self._lk_withheld_warning = RateLimitedWarning(lease_logger())
        self._lk_end_warning = RateLimitedWarning(lease_logger())
        self._lk_writes = WriteNoteGuard()

    def start_load_kv(self, metadata: Any) -> None:
        """LeaseKit's and vLLM's ``start_load_kv``; each new lease's base id becomes matchable by registrations."""
        super().start_load_kv(metadata)
        if self._lk_ready:
            for req_id in metadata.reqs_to_send:
                if req_id in self._reqs_to_send:
                    self._lk_flow.granted(req_id)

    def _lk_before_stock_load(self, metadata: Any) -> None:
        """D, after any chaos forward-pass stall of this step and before vLLM queues the step's registrations for
        its writer thread: withhold the ones of leases D cannot vouch for (:meth:`_lk_withhold_lapsed`). Only with
        D TP = 1: each D rank judges from its own heartbeat history, and ranks that disagreed would let P WRITE into
        one rank's blocks after another rank failed the load (with D TP > P TP P WRITEs into every D rank on the
        first registration), so with D TP > 1 D withholds nothing, as stock."""
        if getattr(metadata, "push_registrations", None) and getattr(self, "world_size", 1) == 1:
            self._lk_withhold_lapsed(metadata)
        self._lk_ask_for_push_end(metadata)  # P tells D when a lease ends without a WRITE (leasekit.vllm.pushend)

    def _lk_withhold_lapsed(self, metadata: Any) -> None:
        """D: never register for a lease P may have reclaimed. A request whose heartbeats D stopped sending for
        about ``E - H/2`` seconds or longer (:func:`leasekit.lease.bounds.silence_may_expire`, always above the loss
        budget's silence: D was frozen, stalled or could not send) loses its registration before vLLM's writer sends it, and its receive is failed through
        vLLM's own path (``_failed_recv_reqs``, as when a registration cannot be sent; ``base_worker.py``
        ``get_finished``), so the scheduler applies ``kv_load_failure_policy`` (recompute, or an error). Without
        this, D would wait for a WRITE that P, having reclaimed the lease, never issues (vLLM's registration
        watchdog, ``push_scheduler.py`` ``build_connector_meta``, only drops the registration): the request hangs.
        No WRITE can land later in the blocks D then reuses, because P never heard of them. A WARNING, a
        ``registration_withheld`` event on the request's heartbeat span and
        ``leasekit_kv_lease_push_registrations_withheld_total`` say so. Never raises."""
        try:
            regs, now = metadata.push_registrations, time.perf_counter()
            for req_id in list(regs):
                silence = self._lk_hb.longest_silence_s(req_id, now=now)
                if silence is None or not silence_may_expire(silence, self._lk_timing):
                    continue
                del regs[req_id]
                self._failed_recv_reqs.put(req_id)
                self._lk_stats.registration_withheld()
                self._lk_hb.note(req_id, "registration_withheld", {"leasekit.silence_s": round(silence, 6)})
                self._lk_withheld_warning.warn(
                    "LeaseKit: D withheld the push registration of request %s: it sent no heartbeat for it for %.1f s "
                    "(E=%s s), so P may have reclaimed its KV blocks; its load is failed for kv_load_failure_policy "
                    "instead of waiting for a WRITE that may never come", req_id, silence,
                    self._lk_timing.extension_s, event="registration_withheld")
        except Exception as exc:
            self._lk_errors.report("withhold", exc)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        """vLLM's handling of one accepted registration (writer thread), alone: a registration vLLM's WRITE set-up
        raises on (block or group counts P cannot match) is dropped (``internal_error``) instead of losing the rest
        of the writer's batch (vLLM's loop catches only around the whole batch)."""
        if not self._lk_ready:
            return super()._handle_push_reg_notif(notif)
        try:
            super()._handle_push_reg_notif(notif)
        except Exception as exc:
            self._lk_flow.writer_drop("internal_error", "", f"vLLM's writer raised on a registration: "
                                                            f"{type(exc).__name__}: {exc}"[:200])

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """vLLM's WRITE submission (writer thread), then the WRITE noted for the engine thread. A WRITE of a lease
        P's reap already ended is not submitted (its source blocks may have been freed and reused): it is counted
        (``leasekit_kv_lease_push_writes_total{outcome="refused"}``) and logged instead. With fault points enabled,
        a chaos writer stall (``writer_stall_s``) sleeps here first."""
        if not self._lk_ready:
            return super()._xfer_blocks_for_req(req_id, meta)
        if self._lk_faults.enabled:
            stall = self._lk_faults.writer_stall()
            if stall > 0:
                start = time.perf_counter()
                time.sleep(stall)
                self._lk_faults.record_writer_stall(start, time.perf_counter())
        flow = self._lk_flow
        if not flow.begin_write(req_id):  # from here the reap holds the lease back until end_write
            d_request_id = flow.refused(req_id)
            if d_request_id is not None:  # D asked to be told: it would wait for this WRITE for ever
                self._lk_send_push_end(self._lk_known_agents(meta.remote.engine_id), d_request_id)
            return
        try:
            super()._xfer_blocks_for_req(req_id, meta)
        finally:
            flow.end_write()
        with self._sending_transfers_lock:
            handles = len(self._sending_transfers.get(req_id, ()))
        if handles:
            flow.issued(req_id, handles)

    def _lk_reap_now(self, now: float) -> float:
        """P in push mode judges D's silence only up to what the writer thread has polled, waiting at most ``E`` for
        it (:meth:`leasekit.vllm.pushflow.PushFlow.reap_clock`)."""
        return self._lk_flow.reap_clock(now, float(self._lk_timing.extension_s))

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """LeaseKit's reap (:class:`leasekit.vllm.prefill.hooks.PHooks`) under the flow's ``write_lock``, which the
        writer holds only to check a lease and to mark (unmark) the one it is submitting, never across a submission:
        the engine thread waits microseconds at most, and every other due lease is reaped on time."""
        if not self._lk_ready:
            return super()._reap_expired_send_leases(done_sending)
        with self._lk_flow.write_lock:
            super()._reap_expired_send_leases(done_sending)

    def _lk_reap_hold(self) -> tuple[str, ...]:
        """The lease whose WRITE the writer is submitting right now is reaped at the next step, not this one."""
        return self._lk_flow.reap_hold()

    def _lk_reaped(self, expired: list[str]) -> None:
        """The writer must not WRITE from the blocks of leases the reap just ended."""
        if expired:
            self._lk_flow.reaped(expired)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        """Stock polling; on ``_sending_transfers`` (P's WRITEs, called with vLLM's lock held) each issued WRITE gets
        one outcome for the engine thread: ``failed`` the first poll a handle of it fails (vLLM reports a failing
        request on every poll until its last handle ends, ``base_worker.py`` ``_pop_done_transfers``, and then keeps
        the lease until it expires, ``push_worker.py`` ``get_transfer_results``), else ``late`` when its handles all
        finished after its lease ended; ``done`` is counted when vLLM releases the lease. So ``issued`` = ``done`` +
        ``failed`` + ``late`` + the WRITEs in flight."""
        done, failed = super()._pop_done_transfers(transfers)
        if self._lk_ready and transfers is self._sending_transfers:
            self._lk_failed.extend(sorted(failed - self._lk_failing))
            self._lk_failing |= failed
            self._lk_late.extend(r for r in done if r not in self._reqs_to_send and r not in self._reqs_to_process
                                 and r not in self._lk_failing)
            self._lk_failing -= done  # no handle left: never reported again
        return done, failed

    def _lk_after_results(self, results: Any) -> None:
        """After vLLM's ``get_transfer_results``: leases in ``finished_sending`` still open were released by their
        WRITE (expired ones were ended by the reap); record late and failed WRITEs, the writer thread's drops and
        WRITEs issued."""
        flow, now = self._lk_flow, time.perf_counter()
        flow.record(self._lk, self._lk_stats)
        for req_id in results.finished_sending or ():
            self._lk_p.keeping.forget(req_id)  # its heartbeat binding
            if self._lk.has(req_id):
                self._lk.annotate(req_id, {"leasekit.push.write_done_monotonic_s": now})
                self._lk.release(req_id, now=now)
                self._lk_stats.push_write("done")
            flow.ended(req_id)
        for req_id in self._lk_failed:
            self._lk_stats.push_write("failed")
        for req_id in self._lk_late:
            self._lk_stats.push_write("late")
            self._lk.late_write(req_id, now=now)
            self._lk_late_warning.warn("LeaseKit: the WRITE of request %s finished after its lease ended: P had freed "
                                       "its KV blocks, D may have received reused blocks", req_id, event="late_write")
        for req_id in flow.take_refused():
            self._lk_stats.push_write("refused")
            self._lk_late_warning.warn("LeaseKit: P did not WRITE request %s: its lease had expired before P's writer "
                                       "thread reached it (its KV blocks may have been reused); a LeaseKit D is told and "
                                       "recomputes it, a stock D waits for it until its client gives up",
                                       req_id, event="write_refused")
        self._lk_failed, self._lk_late = [], []

    def _lk_write_senders(self, req_id: str) -> set[str]:
        """D: the NIXL agent names of the P engine request ``req_id`` registered with (those D sent its ``PUSH_REG``
        to; empty when D has no handshake with it)."""
        remote = getattr(self._recving_metadata.get(req_id), "remote", None)
        with self._handshake_lock:
            return set((self._remote_agents.get(getattr(remote, "engine_id", None)) or {}).values())

    def _get_new_notifs(self) -> set[str]:
        """The writer thread's forwarded notifications, with their senders: heartbeats (and anything malformed) to
        P's notification intake; a WRITE notification for a request D waits on to vLLM's accounting when it comes
        from an agent of the request's P engine, once per agent (else dropped: ``foreign_write``,
        ``duplicate_write``, :mod:`leasekit.vllm.decode.writenotes`); one for a
        request D no longer waits on is a late write (D) and a read completion on P is dropped
        (``push_completion``). Returns nothing: P frees on its WRITE handles (vllm 0.33.0). Never raises for
        anything a peer sent."""
        if not self._lk_ready:
            return super()._get_new_notifs()
        p_batch: dict[str, list[bytes]] = {}
        forward = False
        consumer = bool(self.kv_transfer_config.is_kv_consumer)
        intake = self._lk_p.intake
        for agent, messages in self._lk_flow.take_notifications().items():
            for msg in messages:
                if isinstance(msg, (bytes, bytearray)) and msg[:3] == HEARTBEAT_PREFIX:
                    p_batch.setdefault(agent, []).append(msg)  # the hot path: decoded once, by the intake
                    continue
                if consumer and is_push_end(msg):
                    self._lk_push_end_received(agent, bytes(msg))
                    continue
                note = decode_notification(msg, max_bytes=intake.max_bytes)
                if not isinstance(note, Completion):
                    p_batch.setdefault(agent, []).append(msg)
                elif note.req_id in self._recving_metadata:
                    senders = self._lk_write_senders(note.req_id)
                    why = self._lk_writes.admit(note.req_id, agent, senders)
                    if why is not None:
                        intake.drop(why, agent, f"WRITE notification for {note.req_id!r} from an agent that is " + (
                            f"not one of its P engine's ({', '.join(sorted(peer_ref(a) for a in senders)) or 'none'})"
                            if why == FOREIGN_WRITE else "already counted for it"))
                        continue
                    self._pending_completion_notifs.put(bytes(msg))
                    forward = True
                elif consumer:
                    self.xfer_stats.record_notification_after_expiry()  # as vLLM counts it
                    self._lk_stats.late_write()
                    self._lk_late_warning.warn(
                        "LeaseKit: a WRITE of request %s from agent %s finished after D stopped waiting for it: its "
                        "KV blocks may have been reused", note.req_id, peer_ref(agent), event="late_write")
                else:
                    intake.drop("push_completion", agent, f"read completion for {note.req_id!r} in push mode "
                                "(P frees on its WRITE)")
        if p_batch:
            intake.drain(p_batch, time.perf_counter())
        if consumer:
            self._lk_writes.prune(self._recving_metadata)
        if forward:  # vLLM's own method (not PHooks', the pull-mode intake next in the MRO)
            NixlPushConnectorWorker._get_new_notifs(self)  # its accounting of the WRITE notifications D waits on
        return set()


class LeaseKitPushConnector(LeaseKitConnectorStatsMixin, NixlPushConnector):
    """vLLM's push-mode NixlPushConnector with lease spans on every P worker (module docstring).

    Raises: as :class:`leasekit.vllm.connector.LeaseKitConnector` (an unsupported vLLM release at import; a
    ``kv_lease_duration`` or ``leasekit_*`` value out of range at start)."""

    _lk_mode = "push"

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        # Same as NixlPushConnector.__init__ (its refusal included), with our scheduler/worker classes.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("LeaseKitPushConnector (as vLLM's NixlPushConnector) does not support "
                             "decode_context_parallel_size > 1; fix: use pull mode (LeaseKitConnector)")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = LeaseKitPushScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = LeaseKitPushWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
