"""The worker part LeaseKit's pull and push connectors share: :class:`LeaseKitWorkerMixin` builds P's and D's
components over vLLM's NIXL worker (``_lk_setup``), records grants at ``start_load_kv``, keeps the step's
bookkeeping at ``get_transfer_results`` and tears everything down at ``shutdown``. It is the first base of
:class:`leasekit.vllm.connector.LeaseKitPullWorker` (over vLLM's ``NixlPullConnectorWorker``) and of
:class:`leasekit.vllm.push.LeaseKitPushWorker` (over ``NixlPushConnectorWorker``); each of its methods calls
vLLM's through ``super()``.

Import it through :mod:`leasekit.vllm.connector`, which checks the vLLM release first.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from leasekit.lease.config import DEFAULT_LEASE_DURATION_S, LeaseTiming
from leasekit.lease.peerref import peer_ref
from leasekit.lease.readgate import agent_name
from leasekit.lease.settings import (
    RUN_DIR_EXTRA_KEY,
    fail_closed_enabled,
    notification_settings,
    pledge_seconds,
    verdict_allow,
    verdict_timeout,
)
from leasekit.telemetry.decode_spans import HeartbeatSpanRecorder
from leasekit.telemetry.lease_log import LeaseLogObserver, RateLimitedWarning, lease_logger
from leasekit.telemetry.lease_spans import LeaseSpanRecorder
from leasekit.telemetry.provider import build_tracer_provider
from leasekit.telemetry.span_builder import SpanBuilder
from leasekit.vllm.clockid import local_clock_id
from leasekit.vllm.decode.gate import DReadGate
from leasekit.vllm.decode.heartbeats import DHeartbeatSender
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.faultpoints import FaultPoints
from leasekit.vllm.kvdigest import KV_DIGEST_ATTR, kv_digest
from leasekit.vllm.prefill.hooks import build_prefill
from leasekit.vllm.prefill.vllmstate import VllmSendState
from leasekit.vllm.scheduler import (
    METADATA_BLOCK_IDS_ATTR,
    METADATA_BLOCKS_ATTR,
    METADATA_FINISHED_ATTR,
    METADATA_LEASE_KEY_ATTR,
    METADATA_PEERS_ATTR,
    METADATA_PROTECTED_ATTR,
    METADATA_TRACE_ATTR,
    METADATA_TRACKED_ATTR,
    METADATA_UNTRACKED_ATTR,
)
from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.taps import NotificationTap, TelemetryErrors

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.leasekit.connector")

RUN_DIR_ENV = "LEASEKIT_RUN_DIR"
DEFAULT_RUN_DIR = "leasekit-run"


def _run_dir(kv_transfer_config: Any) -> str:
    configured = kv_transfer_config.get_from_extra_config(RUN_DIR_EXTRA_KEY, None)
    return str(configured or os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR)


class LeaseKitWorkerMixin:
    """LeaseKit's part of a NIXL worker (pull or push): records every lease transition as span events and
    handles D's notifications robustly (:mod:`leasekit.vllm.prefill.notifications`). Its subclass names the
    transfer mode (:attr:`_lk_mode`: ``\"pull\"`` or ``\"push\"``, a resource attribute of every span) and may add
    its own components in :meth:`_lk_setup_mode`.

    A worker whose LeaseKit part never ran (``_lk_ready`` False: built without ``__init__``, as vLLM's own
    unit tests build workers with ``object.__new__``) behaves exactly as vLLM's: every override hands the
    call to vLLM's method. ``__init__`` either finishes ``_lk_setup`` or raises, so an engine never runs a
    half-built worker."""

    _lk_ready = False
    _lk_mode = "pull"
    _lk_tap_class: Any = NotificationTap

    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._lk_setup(engine_id)

    def _lk_setup(self, engine_id: str) -> None:
        """LeaseKit's part of ``__init__``, run once vLLM's worker ``__init__`` has set its attributes
        (``kv_transfer_config``, ``tp_rank``, ``nixl_wrapper``, ``_reqs_to_send`` ...). Benchmarks and tests
        that build the stock part without a NIXL agent (as ``tests/vllm_replay.py`` does) call it directly.

        Raises the configuration errors listed on :class:`LeaseKitConnector`."""
        self._lk_errors = TelemetryErrors(logger)
        self._lk_ready = False
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
                "leasekit.transfer_mode": self._lk_mode,
                "process.pid": os.getpid(),
            },
        )
        self.xfer_stats = LeaseKitKVConnectorStats()  # vLLM's NIXL stats keep flowing through it
        self._lk_stats = LeaseStatsObserver(self.xfer_stats, self.tp_rank)
        self._lk_stats.config(kv_role, timing)
        self._lk_timing = timing
        max_hold_s, max_bytes = notification_settings(self.kv_transfer_config, timing.lease_duration_s)
        self._lk_stats.max_hold(kv_role, max_hold_s)
        tracer = self._lk_provider.get_tracer("leasekit.vllm")
        self._lk_spans = SpanBuilder(background=True, name=f"leasekit-spans-tp{self.tp_rank}")
        self._lk = LeaseSpanRecorder(
            tracer,
            engine_id=engine_id,
            tp_rank=self.tp_rank,
            timing=timing,
            kv_role=kv_role,
            observers=(self._lk_stats, LeaseLogObserver()),
            spans=self._lk_spans,
        )
        self._lk_span_drops = (0, 0)
        self._lk_drops_at = 0.0
        self._lk_gauge_at, self._lk_soon = 0.0, 0
        atexit.register(self._lk_spans.close, 2.0)  # before the provider's own exit hook (LIFO): build what is queued
        fail_closed = bool(self._lk_mode == "pull" and self.kv_transfer_config.is_kv_producer  # push: D reads nothing
                           and fail_closed_enabled(self.kv_transfer_config))
        self._lk_p = build_prefill(VllmSendState(self), timing=timing, max_hold_s=max_hold_s, max_bytes=max_bytes,
                                   recorder=self._lk, stats=self._lk_stats, errors=self._lk_errors,
                                   own_agent=agent_name(getattr(self.nixl_wrapper, "name", "")), fail_closed=fail_closed,
                                   pledge_s=pledge_seconds(self.kv_transfer_config, timing.lease_duration_s),
                                   clock_id=local_clock_id(),  # P's components: leasekit.vllm.prefill
                                   verdict_allow=verdict_allow(self.kv_transfer_config))
        self._lk_faults = FaultPoints.from_env(self.tp_rank)
        self._lk_hb = HeartbeatSpanRecorder(tracer, engine_id=engine_id, tp_rank=self.tp_rank, kv_role=kv_role)
        d_state = VllmDState(self)  # D's components: leasekit.vllm.decode
        self._lk_gate = DReadGate(d_state, timeout_s=verdict_timeout(self.kv_transfer_config, timing.lease_duration_s),
                                  lease_duration_s=timing.lease_duration_s, tracer=tracer, stats=self._lk_stats,
                                  errors=self._lk_errors, faults=self._lk_faults, drop=self._lk_p.intake.drop,
                                  context_of=self._lk_hb.context_of, warning=RateLimitedWarning(lease_logger()))
        self._lk_dbeats = DHeartbeatSender(d_state, spans=self._lk_hb, stats=self._lk_stats, errors=self._lk_errors,
                                           faults=self._lk_faults, extension_s=timing.extension_s,
                                           warning=RateLimitedWarning(lease_logger()))
        self._lk_tap = self._lk_tap_class(self.nixl_wrapper, self._lk_dbeats.sent)
        self._lk_tap.rewrite = self._lk_gate.sequence_heartbeat
        self.nixl_wrapper = self._lk_tap
        self._lk_last_step: float | None = None
        self._lk_step_gap: float | None = None
        self._lk_setup_mode(timing, max_bytes)
        if self._lk_faults.enabled:
            self._lk_faults.write_state()  # first clock probe
            logger.warning("LeaseKitConnector fault points ENABLED (%s): for chaos testing only", self._lk_faults.path)
        logger.info(
            "LeaseKitConnector worker tp_rank=%d engine=%s NIXL agent %s (%s): L=%s s, H=%s s, E=%s s; lease spans -> %s",
            self.tp_rank,
            engine_id,
            self._lk_p.replies.own_agent,
            peer_ref(self._lk_p.replies.own_agent),
            timing.lease_duration_s,
            timing.heartbeat_interval_s,
            timing.extension_s,
            ", ".join(sinks) or "nowhere",
        )
        self._lk_ready = True

    def _lk_setup_mode(self, timing: LeaseTiming, max_bytes: int) -> None:
        """The transfer mode's own components, built at the end of ``_lk_setup`` (``timing``: L/H/E; ``max_bytes``:
        the notification size ceiling). None in pull mode."""

    def _lk_after_results(self, results: Any) -> None:
        """The transfer mode's bookkeeping after vLLM's ``get_transfer_results`` (``results``: vLLM's
        ``KVConnectorTransferResults``), before leases that left ``_reqs_to_send`` unexplained are aborted. None in
        pull mode (releases come from D's completions)."""

    # -- grant -----------------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        """Stock ``start_load_kv``, then a grant for each new ``_reqs_to_send`` entry.

        With fault points enabled, a configured forward-pass stall sleeps here first."""
        if not self._lk_ready:
            return super().start_load_kv(metadata)
        if self._lk_faults.enabled:
            self._lk_dbeats.apply_stall()
        self._lk_gate.protect(getattr(metadata, METADATA_PROTECTED_ATTR, None))
        self._lk_gate.finish(getattr(metadata, METADATA_FINISHED_ATTR, None))
        self._lk_before_stock_load(metadata)
        super().start_load_kv(metadata)
        self._lk_dbeats.track(getattr(metadata, METADATA_TRACKED_ATTR, None),
                              getattr(metadata, METADATA_UNTRACKED_ATTR, None))
        now = time.perf_counter()
        if metadata.reqs_to_send:
            self._lk_p.leases.index(metadata.reqs_to_send, now)  # outside the telemetry guard
            self._lk_grants(metadata)
        self._lk_p.pledges.take(metadata, now)
        self._lk_p.take_metadata(getattr(metadata, METADATA_LEASE_KEY_ATTR, None),
                                 getattr(metadata, METADATA_PEERS_ATTR, None))

    def _lk_before_stock_load(self, metadata: Any) -> None:
        """Hook of a transfer mode, run in ``start_load_kv`` after any chaos forward-pass stall and right before
        vLLM's own ``start_load_kv`` takes this step's metadata; pull mode: nothing."""

    def _lk_grants(self, metadata: Any) -> None:
        """A grant (lease span) for each new ``_reqs_to_send`` entry of this step's metadata."""
        try:
            blocks = getattr(metadata, METADATA_BLOCKS_ATTR, None) or {}
            traces = getattr(metadata, METADATA_TRACE_ATTR, None) or {}
            for req_id in metadata.reqs_to_send:
                deadline = self._reqs_to_send.get(req_id)
                if deadline is not None and not self._lk.has(req_id):
                    self._lk.grant(req_id, deadline, kv_blocks=blocks.get(req_id), trace_headers=traces.get(req_id))
                    block_ids = (getattr(metadata, METADATA_BLOCK_IDS_ATTR, None) or {}).get(req_id)
                    if block_ids and self._lk_faults.enabled:
                        self._lk.annotate(req_id, {KV_DIGEST_ATTR: kv_digest(self, block_ids) or ""})
        except Exception as exc:  # telemetry must never stop the engine
            self._lk_errors.report("grant", exc)

    # -- step bookkeeping ------------------------------------------------------------------
    def get_transfer_results(self) -> Any:
        """Stock results; records the step gap and ends leases that vanished without a transition."""
        if not self._lk_ready:
            return super().get_transfer_results()
        now = time.perf_counter()
        self._lk_step_gap = None if self._lk_last_step is None else now - self._lk_last_step
        self._lk_last_step = now
        results = super().get_transfer_results()  # type: ignore[misc]
        try:
            self._lk_after_results(results)
            deferred = self._lk_p.pledges.deferred
            if self._lk.active > len(self._reqs_to_send) + len(deferred):
                for req_id in self._lk.open_ids():
                    if req_id not in self._reqs_to_send and req_id not in deferred:
                        self._lk.abort(req_id, "left _reqs_to_send without release or expiry")
            if now >= self._lk_drops_at:  # once a second: the counters only grow
                self._lk_drops_at = now + 1.0
                self._lk_report_span_drops()
            self._lk_p.intake.sweep_bindings()
            self._lk_p.pledges.sweep(now)
            if self._lk.active or self._lk_stats.active or self._lk_stats.pinned_blocks:
                if now >= self._lk_gauge_at:  # once a second: O(k log n) with k leases near their deadline
                    self._lk_gauge_at = now + 1.0
                    self._lk_soon = self._lk_p.leases.expiring_within(self._lk_timing.heartbeat_interval_s, now)
                self._lk_stats.state(self._lk_soon)
            else:
                self._lk_stats.state(0)
        except Exception as exc:
            self._lk_errors.report("step", exc)
        return results

    def _lk_report_span_drops(self) -> None:
        """Queue the increase, since the last step, of the spans the provider dropped or failed to export
        (``leasekit_spans_dropped_total``). Two lock-guarded reads per sink; no I/O. Called once a second."""
        dropped = self._lk_provider.dropped_spans() + self._lk_spans.dropped
        failed = self._lk_provider.failed_spans() + self._lk_spans.failed
        last_dropped, last_failed = self._lk_span_drops
        if dropped != last_dropped or failed != last_failed:
            self._lk_span_drops = (dropped, failed)
            if dropped > last_dropped:
                self._lk_stats.spans_dropped("queue_full", dropped - last_dropped)
            if failed > last_failed:
                self._lk_stats.spans_dropped("export_failed", failed - last_failed)

    # -- extend, retrieval, release, expire: leasekit.vllm.prefill.hooks.PHooks ---------------

    def shutdown(self) -> None:
        """Abort open lease spans (outcome ``aborted``, reason ``worker shutdown``), flush, stock shutdown."""
        if not self._lk_ready:
            return super().shutdown()
        for step in (lambda: self._lk.abort_all("worker shutdown"), lambda: self._lk_hb.untrack_all("worker shutdown"),
                     self._lk_gate.close, self._lk_p.replies.close, self._lk_spans.close,
                     self._lk_provider.shutdown):
            try:  # each step on its own: spans are flushed even if closing a socket failed
                step()
            except Exception as exc:
                self._lk_errors.report("shutdown", exc)
        super().shutdown()
