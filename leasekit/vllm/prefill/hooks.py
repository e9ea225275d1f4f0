"""The P-side parts of LeaseKitConnector's NIXL worker: :func:`build_prefill` builds P's components over
vLLM's lease state, and :class:`PHooks` overrides vLLM's P hooks by forwarding to them.

:class:`PHooks` is a base of :class:`leasekit.vllm.connector.LeaseKitPullWorker` that overrides two
methods of vllm 0.32.0's NIXL worker (``.../kv_connector/v1/nixl/``) and nothing else; it holds NO state
and sets no attribute:

- ``_get_new_notifs`` (``pull_worker.py``): the notification intake (extend, retrieval, release, late
  reads);
- ``_reap_expired_send_leases`` (``base_worker.py``): vLLM's own reap on the leases the expiry heap says
  are due, then an ``expire`` lease event for each.

A worker whose LeaseKit part never ran (``_lk_ready`` False, the worker's class default: built without
``__init__``, as vLLM's own unit tests build workers) behaves exactly as vLLM's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from leasekit.lease.config import LeaseTiming
from leasekit.lease.pkeeping import PLeaseKeeping
from leasekit.vllm.prefill.expiry import ExpiryIndex
from leasekit.vllm.prefill.notifications import PNotificationIntake
from leasekit.vllm.prefill.pledges import PledgeHolds
from leasekit.vllm.prefill.replies import VerdictReplies
from leasekit.vllm.prefill.vllmstate import VllmSendState


@dataclass(frozen=True)
class PComponents:
    """P's components of one worker (:mod:`leasekit.vllm.prefill`), as :func:`build_prefill` wires them."""

    state: VllmSendState
    keeping: PLeaseKeeping
    leases: ExpiryIndex
    pledges: PledgeHolds
    replies: VerdictReplies
    intake: PNotificationIntake

    def take_metadata(self, lease_key: bytes | None, peers: list[str] | None) -> None:
        """This step's ``leasekit_lease_key`` (the engine key the scheduler mints lease secrets with: from now on
        tags verify; a key of the wrong type or length is ignored) and ``leasekit_side_channel_peers`` (addresses
        the handshake listener served: the default verdict-channel allowlist). Never raises."""
        proofs = self.keeping.proofs
        if proofs.key is None and type(lease_key) is bytes and 16 <= len(lease_key) <= 64:
            proofs.key = lease_key
        if peers:
            self.replies.allow_peers(peers)


def build_prefill(state: VllmSendState, *, timing: LeaseTiming, max_hold_s: float, max_bytes: int, recorder: Any,
                  stats: Any, errors: Any, own_agent: str, fail_closed: bool, pledge_s: float,
                  clock_id: str | None, verdict_allow: tuple = ()) -> PComponents:
    """P's lease keeping (:class:`leasekit.lease.pkeeping.PLeaseKeeping`, the pure rules) and the components
    that apply it to vLLM's lease state: the expiry heap over ``_reqs_to_send``, the pledge holds, the
    verdict channel and the notification intake.

    Args:
        state: vLLM's lease state on the worker. timing: ``L``/``H``/``E``. max_hold_s: ``leasekit_max_hold_s``
            (seconds). max_bytes: the largest notification handled. recorder: the lease span recorder.
        stats: the lease stats observer. errors: :class:`leasekit.vllm.taps.TelemetryErrors`.
        own_agent: this worker's NIXL agent name. fail_closed: this P speaks the fail-closed protocol.
        pledge_s: the grant pledge in seconds (0: none; forced to 0 when not ``fail_closed``).
        clock_id: this worker's clock id (:func:`leasekit.vllm.clockid.local_clock_id`).
        verdict_allow: networks (:class:`ipaddress.IPv4Network`/``IPv6Network``) a verdict channel may go to
            (``leasekit_verdict_allow``); empty: the addresses P's handshake listener served.

    Raises:
        ValueError: ``max_hold_s`` shorter than ``L``, or ``pledge_s`` negative.
    """
    keeping = PLeaseKeeping(timing, max_hold_s=max_hold_s, pledge_s=pledge_s if fail_closed else 0.0,
                            on_binding=stats.binding)
    leases = ExpiryIndex(state.reqs_to_send, keeping.table)
    pledges = PledgeHolds(state, keeping, recorder, stats, clock_id=clock_id)
    intake: list[PNotificationIntake] = []
    replies = VerdictReplies(own_agent, stats, lambda *drop: intake[0].drop(*drop), keeping.proofs, clock_id=clock_id,
                             enabled=fail_closed, allow=verdict_allow)
    intake.append(PNotificationIntake(state, keeping, pledges, replies, recorder, stats, errors, max_bytes=max_bytes))
    return PComponents(state, keeping, leases, pledges, replies, intake[0])


class PHooks:
    """P's overrides of vLLM's NIXL worker methods; stateless, forwarding only (see the module).

    Reads, on the worker it is a base of: ``_lk_ready`` (bool), ``_lk_p`` (:class:`PComponents`), ``_lk``
    (the lease span recorder), ``_lk_errors`` and ``_lk_step_gap`` (seconds since the previous step, or None)."""

    def _get_new_notifs(self) -> set[str]:
        """Drain NIXL notifications through :class:`leasekit.vllm.prefill.notifications.PNotificationIntake`;
        returns the request ids whose blocks every consumer read (stock contract). Never raises for
        anything a peer sent."""
        if not self._lk_ready:
            return super()._get_new_notifs()  # type: ignore[misc]
        batch = self.nixl_wrapper.get_new_notifs()
        return self._lk_p.intake.drain(batch, time.perf_counter())

    def _lk_reap_now(self, now: float) -> float:
        """The instant (perf_counter s) up to which this step's reap judges D's silence: ``now`` in pull mode, where
        the engine thread drains NIXL itself right before the reap (push mode overrides it)."""
        return now

    def _lk_reap_hold(self) -> tuple[str, ...]:
        """Leases this step's reap must not end even if due (reaped at the next step): none in pull mode."""
        return ()

    def _lk_reaped(self, expired: list[str]) -> None:
        """Hook of a transfer mode: the reap just expired ``expired`` (request ids). Nothing in pull mode."""

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """vLLM's reap, on the leases the expiry heap says are due, then an expire event for each.

        Stock (vllm 0.32.0 ``nixl/base_worker.py: _reap_expired_send_leases``) scans every entry of
        ``_reqs_to_send`` each step (O(n)). Here the expiry heap
        (:meth:`leasekit.vllm.prefill.expiry.ExpiryIndex.reap`) yields the leases with ``deadline <= now`` in
        O(k log n), each checked against ``_reqs_to_send``; vLLM's own method then reaps exactly those (its
        accounting, stats and log line unchanged) with ``_reqs_to_send`` narrowed to them. Same semantics:
        called after the step's notifications were drained; a deadline is never shortened; every expired
        lease is reported once."""
        if not self._lk_ready:
            return super()._reap_expired_send_leases(done_sending)  # type: ignore[misc]
        p = self._lk_p
        expired = p.leases.reap(p.state, done_sending, super()._reap_expired_send_leases,  # type: ignore[misc]
                                self._lk_reap_now(time.perf_counter()), self._lk_reap_hold())
        self._lk_reaped(expired)
        for req_id in expired:
            p.keeping.forget(req_id)
            try:  # each on its own: one failure must not turn the others' expiries into aborts
                self._lk.expire(req_id, step_gap_s=self._lk_step_gap, cause=p.intake.expiry_cause(req_id))
            except Exception as exc:
                self._lk_errors.report("expire", exc)
