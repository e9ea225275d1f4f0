"""D's heartbeat sending in LeaseKitConnector's NIXL worker: counted, logged when it fails, and the
chaos fault points of the send path and the forward pass.

Hooks of vllm 0.32.0 (``.../kv_connector/v1/nixl/base_worker.py``): ``_send_heartbeats`` (stock sending,
after a hello to P engines that speak the fail-closed protocol, :mod:`leasekit.vllm.decode.gate`; with fault
points enabled, batches may be dropped, delayed or duplicated here, with real NIXL underneath) and the
NIXL wrapper's ``send_notif`` (through :class:`leasekit.vllm.taps.NotificationTap`, which calls
:meth:`DHeartbeats._lk_heartbeat_sent` per heartbeat notification).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from leasekit.vllm.taps import HEARTBEAT_PREFIX as _HEARTBEAT_PREFIX
from leasekit.vllm.taps import HeartbeatBatch


class DHeartbeats:
    """Mixin for LeaseKitConnector's NIXL worker (needs vLLM's ``_remote_agents`` and LeaseKit's
    ``_lk_stats``, ``_lk_hb``, ``_lk_hb_warning``, ``_lk_timing``, ``_lk_tap``, ``_lk_faults``,
    ``_lk_errors`` and the read gate's ``_lk_hello_engines``)."""

    _lk_ready = True  # its init ran (LeaseKitPullWorker, whose class default is False, sets it after _lk_setup)

    def _lk_heartbeat_sent(self, agent_name: str, notif_msg: bytes, ok: bool) -> None:
        """Count one heartbeat notification (D): metric, span counts, rate-limited WARNING on failure."""
        try:
            engine = next(
                (eid for eid, agents in self._remote_agents.items() if agent_name in agents.values()), "unknown"
            )
            self._lk_stats.heartbeat(engine, ok)
            if ok:
                ids = bytes(notif_msg)[len(_HEARTBEAT_PREFIX):].decode("utf-8", "replace").split(",")
                self._lk_hb.sent(ids)
            else:
                self._lk_hb_warning.warn(
                    "LeaseKit: heartbeat notification to P engine %s (NIXL agent %s) failed to send; "
                    "P will expire its leases if this persists longer than E=%s s",
                    engine, agent_name, self._lk_timing.extension_s,
                    event="heartbeat_send_failure", remote_engine_id=engine, tp_rank=self.tp_rank,
                )
        except Exception as exc:
            self._lk_errors.report("heartbeat", exc)

    def _lk_apply_stall(self) -> None:
        faults = self._lk_faults
        faults.poll()
        stall = faults.forward_stall()
        if stall > 0:
            start = time.perf_counter()
            time.sleep(stall)
            faults.record_stall(start, time.perf_counter())

    # -- heartbeats (D side) ---------------------------------------------------------------
    def _send_heartbeats(self, metadata: Any) -> None:
        """Stock heartbeat sending; with fault points enabled, batches may be dropped, delayed or
        duplicated here, in the send path, with real NIXL underneath."""
        if not self._lk_ready:
            return super()._send_heartbeats(metadata)
        self._lk_hello_engines(metadata.heartbeat_by_engine)
        faults = self._lk_faults
        if not faults.enabled:
            super()._send_heartbeats(metadata)
            return
        now = time.perf_counter()
        while faults.delayed and faults.delayed[0][0] <= now:
            _, batch = faults.delayed.pop(0)
            super()._send_heartbeats(HeartbeatBatch(batch))
        batch = metadata.heartbeat_by_engine
        if not batch:
            return
        ids = sorted(rid for info in batch.values() for rid in info.req_ids)
        action, copies, delay = faults.heartbeat_action()
        if action == "drop":
            faults.record_heartbeat("drop", ids)
        elif action == "delay":
            frozen = {engine: copy.copy(info) for engine, info in batch.items()}
            for info in frozen.values():
                info.req_ids = set(info.req_ids)
            faults.delayed.append((now + delay, frozen))
            faults.delayed.sort(key=lambda item: item[0])
            faults.record_heartbeat("delay", ids)
        else:
            for _ in range(copies):
                super()._send_heartbeats(metadata)
            faults.record_heartbeat("send", ids, copies)

