"""D's heartbeat sending in LeaseKitConnector's NIXL worker: counted, logged when it fails, the heartbeat
spans' tracking, and the chaos fault points of the send path and the forward pass.

:class:`DHeartbeatSender` is the component LeaseKit's worker owns (``_lk_dbeats``). The worker's hooks
of vllm 0.32.0 (``.../kv_connector/v1/nixl/``, :class:`leasekit.vllm.decode.hooks.DHooks`) hand it:
``_send_heartbeats`` (``base_worker.py``; stock sending, after the read gate's hello to P engines that
speak the fail-closed protocol, :mod:`leasekit.vllm.decode.gate`; with fault points enabled, batches may
be dropped, delayed or duplicated here, with real NIXL underneath) -> :meth:`DHeartbeatSender.send`; the
NIXL wrapper's ``send_notif`` (through :class:`leasekit.vllm.taps.NotificationTap`, which calls
:meth:`DHeartbeatSender.sent` per heartbeat notification); and from ``start_load_kv`` (``pull_worker.py``)
the requests D starts and stops heartbeating (:meth:`DHeartbeatSender.track`) and the forward-pass stall
(:meth:`DHeartbeatSender.apply_stall`).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Iterable

from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.taps import HEARTBEAT_PREFIX as _HEARTBEAT_PREFIX
from leasekit.vllm.taps import HeartbeatBatch


class DHeartbeatSender:
    """D's heartbeats: counts each heartbeat notification, keeps the heartbeat spans' request tracking,
    and applies the chaos fault points of the heartbeat send path and the forward pass.

    Args:
        state: vLLM's worker state (:class:`leasekit.vllm.decode.vllmstate.VllmDState`): ``remote_agents``
            (which P engine an agent belongs to) and ``tp_rank``.
        spans: :class:`leasekit.telemetry.decode_spans.HeartbeatSpanRecorder` (``track``, ``untrack``,
            ``sent``).
        stats: :class:`leasekit.vllm.stats.LeaseStatsObserver` (``heartbeat(engine, ok)``).
        errors: :class:`leasekit.vllm.taps.TelemetryErrors` (``report(where, exc)``; never raises).
        faults: :class:`leasekit.vllm.faultpoints.FaultPoints` (``enabled``, ``delayed``, ``poll()``,
            ``heartbeat_action()``, ``record_heartbeat()``, ``forward_stall()``, ``record_stall()``).
        extension_s: E, seconds: how long P waits past a missed heartbeat (named in the failure WARNING).
        warning: rate-limited WARNING for failed sends (default: one on the lease logger).
    """

    def __init__(self, state: VllmDState, *, spans: Any, stats: Any, errors: Any, faults: Any, extension_s: float,
                 warning: RateLimitedWarning | None = None):
        self._state = state
        self._spans = spans
        self._stats = stats
        self._errors = errors
        self._faults = faults
        self._extension_s = extension_s
        self._warning = warning if warning is not None else RateLimitedWarning(lease_logger())

    def sent(self, agent_name: str, notif_msg: bytes, ok: bool) -> None:
        """Count one heartbeat notification ``notif_msg`` (``b"HB:" + b",".join(ids)``) to NIXL agent
        ``agent_name``, sent (``ok``) or raised: metric, span counts, rate-limited WARNING on failure.
        The NIXL wrapper tap's callback. Never raises."""
        try:
            engine = next(
                (eid for eid, agents in self._state.remote_agents.items() if agent_name in agents.values()), "unknown"
            )
            self._stats.heartbeat(engine, ok)
            if ok:
                ids = bytes(notif_msg)[len(_HEARTBEAT_PREFIX):].decode("utf-8", "replace").split(",")
                self._spans.sent(ids)
            else:
                self._warning.warn(
                    "LeaseKit: heartbeat notification to P engine %s (NIXL agent %s) failed to send; "
                    "P will expire its leases if this persists longer than E=%s s",
                    engine, agent_name, self._extension_s,
                    event="heartbeat_send_failure", remote_engine_id=engine, tp_rank=self._state.tp_rank,
                )
        except Exception as exc:
            self._errors.report("heartbeat", exc)

    def track(self, tracked: Iterable[Any] | None, untracked: Iterable[str] | None) -> None:
        """The requests D started (``tracked``: ``(P request id, P engine id, D request id, trace headers)``)
        and stopped (``untracked``: P request ids) heartbeating, from the scheduler's ``on_new_request`` /
        ``_stop_heartbeat`` through the connector metadata; either may be None. Never raises."""
        if tracked or untracked:
            try:
                for remote_id, remote_engine, decode_id, headers in tracked or ():
                    self._spans.track(remote_id, remote_engine_id=remote_engine, decode_request_id=decode_id,
                                      trace_headers=headers)
                for remote_id in untracked or ():
                    self._spans.untrack(remote_id)
            except Exception as exc:
                self._errors.report("track", exc)

    def apply_stall(self) -> None:
        """Chaos fault point of the forward pass: re-read the fault file and sleep the configured stall
        (seconds), recording it. Call only while ``faults.enabled``."""
        faults = self._faults
        faults.poll()
        stall = faults.forward_stall()
        if stall > 0:
            start = time.perf_counter()
            time.sleep(stall)
            faults.record_stall(start, time.perf_counter())

    def send(self, metadata: Any, stock_send: Callable[[Any], None]) -> None:
        """Send this step's heartbeats (``metadata.heartbeat_by_engine``, P engine id -> info with
        ``req_ids``) with ``stock_send`` (vLLM's ``_send_heartbeats``, ``base_worker.py``). With fault
        points enabled, due delayed batches go first, then this batch may be dropped, delayed or
        duplicated here, in the send path, with real NIXL underneath. Raises what ``stock_send`` raises."""
        faults = self._faults
        if not faults.enabled:
            stock_send(metadata)
            return
        now = time.perf_counter()
        while faults.delayed and faults.delayed[0][0] <= now:
            _, batch = faults.delayed.pop(0)
            stock_send(HeartbeatBatch(batch))
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
                stock_send(metadata)
            faults.record_heartbeat("send", ids, copies)
