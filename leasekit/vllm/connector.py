"""LeaseKitConnector: vLLM's (pull) NixlConnector plus one OpenTelemetry span per lease.

Wire-compatible with stock peers: it sends and accepts exactly what NixlConnector does (heartbeats
``b"HB:" + b",".join(ids)``, completions ``b"{req_id}:{n}"``) and leaves the compatibility hash alone.
It only observes, through these hooks of vllm 0.32.0 (``.../kv_connector/v1/nixl/``):

- grant: new keys of ``_reqs_to_send`` after ``start_load_kv`` (values: deadlines on the worker's
  ``perf_counter``, ``pull_worker.py``); blocks pinned come from the scheduler's ``request_finished``
  through the connector metadata;
- extend: ``_handle_heartbeat`` (``base_worker.py``), attributed to the sending NIXL agent;
- retrieval / release: completion notifications seen by ``_get_new_notifs`` (``pull_worker.py``);
- expire: ids ``_reap_expired_send_leases`` adds to ``done_sending`` (``base_worker.py``);
- abort: a lease that leaves ``_reqs_to_send`` any other way, or is open at worker shutdown.

Configuration (``kv_connector_extra_config``): ``kv_lease_duration`` (vLLM's own),
``leasekit_run_dir`` (span directory; default env ``LEASEKIT_RUN_DIR``, else ``./leasekit-run``).
Telemetry errors are logged (rate-limited) and never raised into the engine loop.
"""

from __future__ import annotations

import copy
import os
import time
from typing import TYPE_CHECKING, Any

import vllm

from leasekit.vllm.version import (
    REQUIRED_SCHEDULER_METHODS,
    REQUIRED_WORKER_METHODS,
    check_hooks,
    check_vllm_release,
)

check_vllm_release(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger  # noqa: E402

from leasekit.lease.config import DEFAULT_LEASE_DURATION_S, LeaseTiming  # noqa: E402
from leasekit.telemetry.lease_spans import LeaseSpanRecorder  # noqa: E402
from leasekit.telemetry.provider import build_tracer_provider  # noqa: E402
from leasekit.vllm.faultpoints import FaultPoints  # noqa: E402

check_hooks(NixlPullConnectorWorker, REQUIRED_WORKER_METHODS)
check_hooks(NixlPullConnectorScheduler, REQUIRED_SCHEDULER_METHODS)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.leasekit.connector")

RUN_DIR_ENV = "LEASEKIT_RUN_DIR"
RUN_DIR_EXTRA_KEY = "leasekit_run_dir"
DEFAULT_RUN_DIR = "leasekit-run"
METADATA_BLOCKS_ATTR = "leasekit_kv_blocks"
_HEARTBEAT_PREFIX = b"HB:"


def _run_dir(kv_transfer_config: Any) -> str:
    configured = kv_transfer_config.get_from_extra_config(RUN_DIR_EXTRA_KEY, None)
    return str(configured or os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR)


class _RateLimitedErrors:
    """Logs telemetry failures at most once per ``interval_s`` seconds, with a suppressed count."""

    def __init__(self, interval_s: float = 10.0):
        self._interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def report(self, where: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            self._suppressed += 1
            return
        logger.warning(
            "LeaseKit telemetry failed in %s (%s: %s); %d earlier failure(s) not logged. "
            "Serving continues; lease spans may be incomplete.",
            where,
            type(exc).__name__,
            exc,
            self._suppressed,
        )
        self._last = now
        self._suppressed = 0


class _NotificationTap:
    """Delegates to the NIXL wrapper; remembers the last ``get_new_notifs`` batch (agent -> msgs)."""

    def __init__(self, wrapped: Any):
        self._wrapped = wrapped
        self.last_batch: dict[str, list[bytes]] = {}
        self._agent_by_msg: dict[bytes, str] | None = None

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        batch = self._wrapped.get_new_notifs(*args, **kwargs)
        self.last_batch = batch
        self._agent_by_msg = None
        return batch

    def agent_of(self, msg: bytes) -> str | None:
        """The agent that sent ``msg`` in the last batch (None if not found)."""
        if self._agent_by_msg is None:
            self._agent_by_msg = {m: agent for agent, msgs in self.last_batch.items() for m in msgs}
        return self._agent_by_msg.get(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class _HeartbeatBatch:
    """Minimal metadata carrying a delayed ``heartbeat_by_engine`` (all ``_send_heartbeats`` reads)."""

    def __init__(self, heartbeat_by_engine: dict):
        self.heartbeat_by_engine = heartbeat_by_engine


class LeaseKitPullScheduler(NixlPullConnectorScheduler):
    """Scheduler side: stock behaviour; also hands each new lease's KV block count to the workers."""

    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._leasekit_blocks: dict[str, int] = {}

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Stock ``request_finished``; records ``sum(len(group))`` blocks for a delayed free (a lease)."""
        delay_free, params = super().request_finished(request, block_ids)
        if delay_free and request.request_id in self._reqs_need_send:
            self._leasekit_blocks[request.request_id] = sum(len(group) for group in block_ids)
        return delay_free, params

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Stock metadata plus ``leasekit_kv_blocks: dict[req_id, int]`` for this step's grants."""
        meta = super().build_connector_meta(scheduler_output)
        setattr(meta, METADATA_BLOCKS_ATTR, self._leasekit_blocks)
        self._leasekit_blocks = {}
        return meta


class LeaseKitPullWorker(NixlPullConnectorWorker):
    """Worker side: stock NIXL pull worker that records every lease transition as span events."""

    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._lk_errors = _RateLimitedErrors()
        lease_duration = self.kv_transfer_config.get_from_extra_config(
            "kv_lease_duration", DEFAULT_LEASE_DURATION_S
        )
        timing = LeaseTiming.from_lease_duration(lease_duration)
        kv_role = str(self.kv_transfer_config.kv_role)
        run_dir = _run_dir(self.kv_transfer_config)
        self._lk_provider, sinks = build_tracer_provider(
            run_dir=run_dir,
            file_stem=f"{kv_role}-{engine_id}-tp{self.tp_rank}",
            resource_attributes={
                "leasekit.engine_id": engine_id,
                "leasekit.tp_rank": self.tp_rank,
                "leasekit.kv_role": kv_role,
                "process.pid": os.getpid(),
            },
        )
        self._lk = LeaseSpanRecorder(
            self._lk_provider.get_tracer("leasekit.vllm"),
            engine_id=engine_id,
            tp_rank=self.tp_rank,
            timing=timing,
            kv_role=kv_role,
        )
        self._lk_tap = _NotificationTap(self.nixl_wrapper)
        self.nixl_wrapper = self._lk_tap
        self._lk_last_step: float | None = None
        self._lk_step_gap: float | None = None
        self._lk_faults = FaultPoints.from_env(self.tp_rank)
        if self._lk_faults.enabled:
            self._lk_faults.write_state()  # first clock probe
            logger.warning("LeaseKitConnector fault points ENABLED (%s): for chaos testing only", self._lk_faults.path)
        logger.info(
            "LeaseKitConnector worker tp_rank=%d engine=%s: L=%s s, H=%s s, E=%s s; lease spans -> %s",
            self.tp_rank,
            engine_id,
            timing.lease_duration_s,
            timing.heartbeat_interval_s,
            timing.extension_s,
            ", ".join(sinks) or "nowhere",
        )

    # -- grant -----------------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        """Stock ``start_load_kv``, then a grant for each new ``_reqs_to_send`` entry.

        With fault points enabled, a configured forward-pass stall sleeps here first."""
        if self._lk_faults.enabled:
            self._lk_apply_stall()
        super().start_load_kv(metadata)
        if not metadata.reqs_to_send:
            return
        try:
            blocks = getattr(metadata, METADATA_BLOCKS_ATTR, None) or {}
            for req_id in metadata.reqs_to_send:
                deadline = self._reqs_to_send.get(req_id)
                if deadline is not None and not self._lk.has(req_id):
                    self._lk.grant(req_id, deadline, kv_blocks=blocks.get(req_id))
        except Exception as exc:  # telemetry must never stop the engine
            self._lk_errors.report("grant", exc)

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
        faults = self._lk_faults
        if not faults.enabled:
            super()._send_heartbeats(metadata)
            return
        now = time.perf_counter()
        while faults.delayed and faults.delayed[0][0] <= now:
            _, batch = faults.delayed.pop(0)
            super()._send_heartbeats(_HeartbeatBatch(batch))
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

    # -- step bookkeeping ------------------------------------------------------------------
    def get_transfer_results(self) -> Any:
        """Stock results; records the step gap and ends leases that vanished without a transition."""
        now = time.perf_counter()
        self._lk_step_gap = None if self._lk_last_step is None else now - self._lk_last_step
        self._lk_last_step = now
        results = super().get_transfer_results()
        try:
            if self._lk.active > len(self._reqs_to_send):
                for req_id in self._lk.open_ids():
                    if req_id not in self._reqs_to_send:
                        self._lk.abort(req_id, "left _reqs_to_send without release or expiry")
        except Exception as exc:
            self._lk_errors.report("step", exc)
        return results

    # -- extend ----------------------------------------------------------------------------
    def _handle_heartbeat(self, payload: str) -> None:
        """Stock heartbeat handling, then an extend event for every named open lease."""
        now = time.perf_counter()  # taken before vLLM's own clock read: never later than it
        super()._handle_heartbeat(payload)
        try:
            if not self._lk.active:
                return
            agent = self._lk_tap.agent_of(_HEARTBEAT_PREFIX + payload.encode())
            for req_id in payload.split(","):
                deadline = self._reqs_to_send.get(req_id)
                if deadline is not None:
                    self._lk.extend(req_id, deadline, remote_agent=agent, now=now)
        except Exception as exc:
            self._lk_errors.report("extend", exc)

    # -- retrieval / release ---------------------------------------------------------------
    def _get_new_notifs(self) -> set[str]:
        """Stock notification handling, then retrieval, release and late-read records."""
        done = super()._get_new_notifs()
        try:
            for agent, msgs in self._lk_tap.last_batch.items():
                for msg in msgs:
                    if msg.startswith(_HEARTBEAT_PREFIX):
                        continue
                    req_id = msg.decode("utf-8", "replace").rsplit(":", 1)[0]
                    if not self._lk.retrieval(req_id, remote_agent=agent):
                        self._lk.late_read(req_id, remote_agent=agent)
            for req_id in done:
                self._lk.release(req_id)
        except Exception as exc:
            self._lk_errors.report("release", exc)
        return done

    # -- expire ----------------------------------------------------------------------------
    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """Stock reap (full scan), then an expire event for each id it added to ``done_sending``."""
        before = len(done_sending)
        already = set(done_sending) if before else ()
        super()._reap_expired_send_leases(done_sending)
        if len(done_sending) == before:
            return
        try:
            for req_id in done_sending:
                if req_id not in already:
                    self._lk.expire(req_id, step_gap_s=self._lk_step_gap)
        except Exception as exc:
            self._lk_errors.report("expire", exc)

    def shutdown(self) -> None:
        """Abort open lease spans (outcome ``aborted``, reason ``worker shutdown``), flush, stock shutdown."""
        try:
            self._lk.abort_all("worker shutdown")
            self._lk_provider.shutdown()
        except Exception as exc:
            self._lk_errors.report("shutdown", exc)
        super().shutdown()


class LeaseKitConnector(NixlPullConnector):
    """vLLM's pull-mode NixlConnector with lease spans on every P worker.

    Load with ``kv_connector="LeaseKitConnector"`` and
    ``kv_connector_module_path="leasekit.vllm.connector"``. Raises
    :class:`leasekit.vllm.version.UnsupportedVllmError` at import on an unsupported vLLM release.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        # Same as NixlPullConnector.__init__, with our scheduler/worker classes (one NIXL agent).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = LeaseKitPullScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = LeaseKitPullWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
