"""LeaseKitConnector's scheduler side (see :mod:`leasekit.vllm.connector`): stock
``NixlPullConnectorScheduler`` of vllm 0.32.0 (``.../kv_connector/v1/nixl/pull_scheduler.py``) that hands
its workers, through the connector metadata, what only the scheduler sees: each new lease's KV block
count and trace headers (P), the requests D starts and stops heartbeating and the ones P marked for the
fail-closed protocol (D); and runs P's robust side-channel handshake listener.

Import it through :mod:`leasekit.vllm.connector`, which checks the vLLM release first.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path

from leasekit.lease.codec import D_ACCEPTED_VERSIONS, PROTOCOL_PARAM, PROTOCOL_VERSION
from leasekit.lease.pledge import PLEDGE_PARAM, encode_pledge, parse_pledge, pledge_until
from leasekit.lease.proof import TOKEN_PARAM, lease_secret, new_engine_key, parse_secret, secret_text
from leasekit.telemetry.lease_log import RateLimitedWarning
from leasekit.lease.settings import fail_closed_enabled, pledge_seconds
from leasekit.vllm.clockid import local_clock_id
from leasekit.vllm.faultpoints import FAULT_FILE_ENV
from leasekit.vllm.prefill.listener import ListenerHealth, serve_handshakes
from leasekit.vllm.stats import LeaseKitKVConnectorStats, ListenerStatsReporter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.leasekit.connector")

METADATA_BLOCKS_ATTR = "leasekit_kv_blocks"
METADATA_TRACE_ATTR = "leasekit_trace_headers"
METADATA_TRACKED_ATTR = "leasekit_tracked"
METADATA_UNTRACKED_ATTR = "leasekit_untracked"
METADATA_PROTECTED_ATTR = "leasekit_protected"
METADATA_FINISHED_ATTR = "leasekit_finished"
METADATA_BLOCK_IDS_ATTR = "leasekit_kv_block_ids"
METADATA_PLEDGES_ATTR = "leasekit_pledges"
METADATA_PLEDGE_CLOCK_ATTR = "leasekit_pledge_clock"
METADATA_LEASE_KEY_ATTR = "leasekit_lease_key"
METADATA_PEERS_ATTR = "leasekit_side_channel_peers"


class LeaseKitSchedulerMixin:
    """Scheduler side, pull or push (the first base of :class:`LeaseKitPullScheduler` and of
    :class:`leasekit.vllm.push.LeaseKitPushScheduler`): stock behaviour; also hands the workers each new lease's KV block count and
    trace headers (P), and the requests D starts and stops heartbeating (D); runs a side-channel
    handshake listener that survives bad requests (:mod:`leasekit.vllm.prefill.listener`) and reports its
    health (P).

    Built without ``__init__`` (``_lk_ready`` False: vLLM's own unit tests build schedulers with
    ``object.__new__``), every method is vLLM's."""

    _lk_ready = False
    _lk_mode = "pull"

    def __init__(self, vllm_config: "VllmConfig", engine_id: str, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, engine_id, kv_cache_config)  # type: ignore[call-arg]
        self._leasekit_blocks: dict[str, int] = {}
        self._leasekit_trace: dict[str, dict[str, str]] = {}
        self._leasekit_tracked: list[list[Any]] = []
        self._leasekit_untracked: list[str] = []
        self._leasekit_protected: list[list[Any]] = []
        self._leasekit_finished: list[str] = []
        self._lk_protected_ids: set[str] = set()
        # push mode: D reads nothing, so there is no read to hold for a verdict (and no lease secret)
        self._lk_fail_closed = self._lk_mode == "pull" and fail_closed_enabled(vllm_config.kv_transfer_config)
        self._lk_pledge_s = pledge_seconds(vllm_config.kv_transfer_config, self._kv_lease_duration)
        self._lk_clock_id = local_clock_id() if self._lk_fail_closed and self._lk_pledge_s > 0 else None
        self._leasekit_pledges: dict[str, float] = {}
        self._leasekit_block_ids: dict[str, list[int]] = {}  # only with fault points (kvdigest.py)
        self._lk_digests = bool(os.environ.get(FAULT_FILE_ENV))
        self._lk_listener = ListenerHealth()
        self._lk_lease_key = new_engine_key() if self._lk_fail_closed else None  # never leaves P's processes
        self._lk_listener_stats = ListenerStatsReporter()
        self._lk_listener_report = bool(vllm_config.kv_transfer_config.is_kv_producer)
        self._lk_listener_warning = RateLimitedWarning(logger)
        self._lk_ready = True

    # -- handshake listener (P) ------------------------------------------------------------
    def _nixl_handshake_listener(self, encoded_data: dict, ready_event: Any, stop_event: Any, host: str,
                                 port: int) -> None:
        """Replaces vLLM's static ``_nixl_handshake_listener``: ``set_xfer_handshake_metadata`` starts
        the thread with target ``self._nixl_handshake_listener`` and these positional args (vllm 0.32.0
        ``nixl/base_scheduler.py``). Same ROUTER socket on vLLM's ``make_zmq_path`` and the same replies
        for good requests; a bad one is refused, counted and survived
        (:func:`leasekit.vllm.prefill.listener.serve_handshakes`). Returns only when ``stop_event`` is set
        (``shutdown``)."""
        if not self._lk_ready:
            return super()._nixl_handshake_listener(encoded_data, ready_event, stop_event, host, port)  # type: ignore[misc]
        serve_handshakes(encoded_data, ready_event, stop_event, make_zmq_path("tcp", host, port), self._lk_listener)

    def listener_stats(self) -> LeaseKitKVConnectorStats | None:
        """The listener's health as connector stats when it changed, else None; None as well on a
        consumer-only engine (in pull mode no D handshakes with D) and before the listener starts.
        Up means the thread is alive (seen from here) and its socket is bound and serving."""
        if not self._lk_ready:
            return None
        try:
            thread = getattr(self, "_nixl_handshake_listener_t", None)
            if not self._lk_listener_report or thread is None:
                return None
            up, served, bad = self._lk_listener.snapshot()
            return self._lk_listener_stats.report(up and thread.is_alive(), served, bad)
        except Exception as exc:  # telemetry must never stop the engine loop
            self._lk_listener_warning.warn("LeaseKit: handshake listener stats failed: %s: %s",
                                           type(exc).__name__, exc, event="listener_stats_error")
            return None

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Stock ``request_finished``; records ``sum(len(group))`` blocks for a delayed free (a lease)
        and the request's W3C trace headers, if it had any."""
        delay_free, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        if not self._lk_ready:
            return delay_free, params
        if request.request_id in self._lk_protected_ids:  # D: the read gate's state for it ends
            self._lk_protected_ids.discard(request.request_id)
            self._leasekit_finished.append(request.request_id)
        if self._lk_fail_closed and delay_free and isinstance(params, dict) and params.get("do_remote_prefill"):
            params[PROTOCOL_PARAM] = PROTOCOL_VERSION  # D may hold its read for P's verdict (decode/gate.py)
            params[TOKEN_PARAM] = secret_text(lease_secret(self._lk_lease_key, request.request_id))  # proof.py
            deadline = self._reqs_need_send.get(request.request_id)
            if self._lk_clock_id is not None and deadline is not None:
                until = pledge_until(time.perf_counter(), self._lk_pledge_s, deadline)
                params[PLEDGE_PARAM] = encode_pledge(until, self._lk_clock_id)
                self._leasekit_pledges[request.request_id] = until  # the workers hold the blocks until then
        if delay_free and request.request_id in self._reqs_need_send:
            self._leasekit_blocks[request.request_id] = sum(len(group) for group in block_ids)
            if self._lk_digests and block_ids:
                self._leasekit_block_ids[request.request_id] = list(block_ids[0])
            headers = getattr(request, "trace_headers", None)
            if headers:
                self._leasekit_trace[request.request_id] = dict(headers)
        return delay_free, params

    def on_new_request(self, request: "Request") -> None:
        """Stock tracking (D); a request it starts heartbeating is handed to the workers as
        ``[P request id, P engine id, D request id, trace headers]``."""
        super().on_new_request(request)  # type: ignore[misc]
        if not self._lk_ready:
            return
        params = request.kv_transfer_params
        marker = params.get(PROTOCOL_PARAM) if params else None
        if params and params.get("do_remote_prefill") and type(marker) is int and marker in D_ACCEPTED_VERSIONS:
            pledge = parse_pledge(params.get(PLEDGE_PARAM))
            secret = parse_secret(params.get(TOKEN_PARAM)) if marker >= 4 else None
            params.pop(TOKEN_PARAM, None)  # read once: vLLM's later DEBUG lines print kv_transfer_params
            self._leasekit_protected.append([request.request_id, params.get("remote_engine_id"),
                                             params.get("remote_host"),
                                             None if pledge is None else list(params[PLEDGE_PARAM]),
                                             params.get("remote_request_id"),
                                             None if secret is None else secret.hex(), marker])
            self._lk_protected_ids.add(request.request_id)
        key = self._heartbeat_req_engine.get(request.request_id)
        if key is not None:
            headers = getattr(request, "trace_headers", None)
            self._leasekit_tracked.append([key[1], key[0], request.request_id, dict(headers) if headers else None])

    def _stop_heartbeat(self, req_id: str) -> None:
        """Stock; a request it stops heartbeating is handed to the workers (P's request id)."""
        if not self._lk_ready:
            return super()._stop_heartbeat(req_id)  # type: ignore[misc]
        key = self._heartbeat_req_engine.get(req_id)
        super()._stop_heartbeat(req_id)  # type: ignore[misc]
        if key is not None:
            self._leasekit_untracked.append(key[1])

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Stock metadata plus this step's ``leasekit_kv_blocks`` (req_id -> blocks),
        ``leasekit_trace_headers`` (req_id -> headers), ``leasekit_tracked`` and ``leasekit_untracked``
        (D's heartbeat tracking), ``leasekit_protected`` (``[D request id, P engine id, P side-channel
        host, pledge [until_us, clock id] or None, P request id, lease secret hex or None, marker]`` P marked for the
        fail-closed protocol), ``leasekit_finished`` (protected requests that finished on D) and
        ``leasekit_kv_block_ids`` (req_id -> block ids, only with chaos fault points) and ``leasekit_pledges`` (P:
        req_id -> pledge end, seconds on this process's ``perf_counter``, rebased by the workers like vLLM's
        deadlines) with ``leasekit_pledge_clock`` (this process's clock id), ``leasekit_lease_key`` (P: the engine key
        its workers check lease proofs with, :mod:`leasekit.lease.proof`; None when P mints no secrets) and
        ``leasekit_side_channel_peers`` (P: the addresses the handshake listener served since the last step, the
        default verdict-channel allowlist); each emptied after."""
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        if not self._lk_ready:
            return meta
        setattr(meta, METADATA_BLOCKS_ATTR, self._leasekit_blocks)
        setattr(meta, METADATA_TRACE_ATTR, self._leasekit_trace)
        setattr(meta, METADATA_TRACKED_ATTR, self._leasekit_tracked)
        setattr(meta, METADATA_UNTRACKED_ATTR, self._leasekit_untracked)
        setattr(meta, METADATA_PROTECTED_ATTR, self._leasekit_protected)
        setattr(meta, METADATA_FINISHED_ATTR, self._leasekit_finished)
        setattr(meta, METADATA_BLOCK_IDS_ATTR, self._leasekit_block_ids)
        setattr(meta, METADATA_PLEDGES_ATTR, self._leasekit_pledges)
        setattr(meta, METADATA_PLEDGE_CLOCK_ATTR, self._lk_clock_id)
        setattr(meta, METADATA_LEASE_KEY_ATTR, self._lk_lease_key)
        setattr(meta, METADATA_PEERS_ATTR, self._lk_listener.take_peers())
        self._leasekit_blocks, self._leasekit_trace, self._leasekit_block_ids = {}, {}, {}
        self._leasekit_pledges = {}
        self._leasekit_tracked, self._leasekit_untracked, self._leasekit_protected = [], [], []
        self._leasekit_finished = []
        return meta


class LeaseKitPullScheduler(LeaseKitSchedulerMixin, NixlPullConnectorScheduler):
    """The scheduler side of :class:`leasekit.vllm.connector.LeaseKitConnector`: vLLM's pull scheduler with
    LeaseKit's part (:class:`LeaseKitSchedulerMixin`)."""
