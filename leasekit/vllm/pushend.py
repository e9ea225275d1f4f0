"""The lease-end notification of :class:`leasekit.vllm.push.LeaseKitPushWorker` (:mod:`leasekit.lease.pushend`), on
both sides:

- D asks for it: a registration it sends P carries ``"leasekit_push_end": 1`` when one P rank WRITEs its request;
- P tells D (writer thread) when no WRITE will come for a registration that asked: the writer refused the WRITE of a
  lease P's reap had already ended (to every D rank of that engine this P rank has handshaked with), or a
  registration arrived for a lease P reaped before accepting any registration of it (``push_reg_lease_ended``, once
  the hold ran out; to the agent that sent it, only if P knows that agent from a handshake; once per agent and id);
- D, on a lease-end notification from an agent of the P engine the request registered with, for a request it still
  waits on, fails that request's load through vLLM's own path (``_failed_recv_reqs``, ``base_worker.py``
  ``get_finished``): vLLM recomputes it (``kv_load_failure_policy``), or frees the blocks of one its client already
  abandoned. Anything else is counted and dropped (``bad_id``, ``unknown_id``, ``foreign_write``). An agent name is
  the sender's claim: this keeps strangers out, not a peer that impersonates P's agent name.
"""

from __future__ import annotations

from typing import Any

from leasekit.lease.pushend import OPT_IN_KEY, PushEndError, decode_push_end, encode_push_end
from leasekit.lease.peerref import peer_ref
from leasekit.vllm.decode.writenotes import FOREIGN_WRITE, agent_name


class PushEndHooks:
    """Mixed into :class:`leasekit.vllm.push.LeaseKitPushWorker`; uses vLLM's ``nixl_wrapper``, ``_remote_agents``,
    ``_handshake_lock``, ``_recving_metadata``, ``_failed_recv_reqs`` and LeaseKit's ``_lk_p.intake``, ``_lk_hb``,
    ``_lk_errors``, ``_lk_write_senders``, ``_lk_end_warning``."""

    def _lk_ask_for_push_end(self, metadata: Any) -> None:
        """D: mark this step's registrations (``metadata.push_registrations``: D request id -> ``PUSH_REG`` map) as
        asking for lease-end notifications, each one whose request exactly one P rank WRITEs (P PP 1 and P TP <= D
        TP; vLLM's D waits for ``pp_size * max(1, P TP // D TP)`` WRITE notifications, ``push_worker.py``
        ``_get_new_notifs``): with several, one P rank's lease end could come while another's WRITE is in flight.
        Never raises."""
        try:
            world = max(1, int(getattr(self, "world_size", 1)))
            for reg_data in (getattr(metadata, "push_registrations", None) or {}).values():
                if not isinstance(reg_data, dict):
                    continue
                producers = int(reg_data.get("remote_pp_size", 1)) * max(1, int(reg_data.get("remote_tp_size", 1)) // world)
                if producers == 1:
                    reg_data[OPT_IN_KEY] = 1
        except Exception as exc:
            self._lk_errors.report("push_end", exc)

    def _lk_known_agents(self, engine_id: str | None = None) -> set[str]:
        """P: the NIXL agent names of D engine ``engine_id`` (every handshaked engine's if None)."""
        with self._handshake_lock:
            engines = self._remote_agents if engine_id is None else {engine_id: self._remote_agents.get(engine_id) or {}}
            return {agent_name(agent) for ranks in engines.values() for agent in ranks.values()}

    def _lk_send_push_end(self, agents: set[str], d_request_id: str) -> None:
        """P (writer thread): tell ``agents`` that the lease of D's request ``d_request_id`` ended without a WRITE.
        Never raises (a failed send is reported as a telemetry error)."""
        try:
            msg = encode_push_end(d_request_id)
        except ValueError as exc:
            self._lk_errors.report("push_end", exc)
            return
        for agent in sorted(agents):
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=msg)
            except Exception as exc:
                self._lk_errors.report("push_end", exc)
        if agents:
            self._lk_end_warning.warn("LeaseKit: told D (%s) that the lease of its request %s ended before P wrote its "
                                      "KV blocks: D fails the load instead of waiting for a WRITE that will not come",
                                      ", ".join(sorted(peer_ref(a) for a in agents)), d_request_id, event="push_end_sent")

    def _lk_end_to_agent(self, agent: str, d_request_id: str) -> None:
        """P (writer thread, :class:`leasekit.vllm.pushflow.PushFlow`'s ``notify_end``): a registration from
        ``agent`` (as NIXL names a sender: bytes or str) named a lease P's reap ended; tell that agent if P knows it
        from a handshake."""
        name = agent_name(agent)
        if name in self._lk_known_agents():
            self._lk_send_push_end({name}, d_request_id)

    def _lk_push_end_received(self, agent: str, msg: bytes) -> None:
        """D (engine thread): a lease-end notification from ``agent``. Never raises for anything a peer sent."""
        intake = self._lk_p.intake
        rid = decode_push_end(msg)
        if isinstance(rid, PushEndError):
            intake.drop(rid.reason, agent, rid.detail)
            return
        if rid not in self._recving_metadata:
            intake.drop("unknown_id", agent, f"lease end for request {rid!r}, which D does not wait on")
            return
        senders = self._lk_write_senders(rid)
        if agent_name(agent) not in {agent_name(a) for a in senders}:  # NIXL hands senders as bytes, vLLM keeps str
            intake.drop(FOREIGN_WRITE, agent, f"lease end for request {rid!r} from an agent that is not one of its P "
                                              f"engine's ({', '.join(sorted(peer_ref(a) for a in senders)) or 'none'})")
            return
        self._failed_recv_reqs.put(rid)
        self._lk_hb.note(rid, "lease_ended_by_p", {"leasekit.remote_agent": peer_ref(agent)})
        self._lk_end_warning.warn("LeaseKit: P ended the lease of request %s before writing its KV blocks; D fails its "
                                  "load for kv_load_failure_policy instead of waiting for the WRITE", rid,
                                  event="push_end_received")
