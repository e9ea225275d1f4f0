"""What LeaseKit needs of each vLLM release: the records the version guard checks
(:mod:`leasekit.vllm.version`), one :class:`ReleaseNeeds` per release in :data:`RELEASE_NEEDS`.

Per release: the vLLM classes LeaseKit hooks (methods with their parameter names, private attributes,
keyword-only calls, words a method body must contain), the ``kv_transfer_params`` keys LeaseKit reads
or writes of vLLM's, the wire literals of the NIXL notifications and the handshake it exchanges with
vLLM peers, the names LeaseKit adds to vLLM's objects (which vLLM must not use), and the log formats the
stock-log parser reads. Records only: no checks, no vLLM import. The next release is one more entry
of :data:`RELEASE_NEEDS` plus a static test against its source distribution
(tests/unit/test_vllm_033_static.py for 0.33.0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from leasekit.lease.codec import PROTOCOL_PARAM
from leasekit.lease.pledge import PLEDGE_PARAM
from leasekit.lease.proof import TOKEN_PARAM

__all__ = ["ClassNeeds", "LEASEKIT_PREFIXES", "NIXL", "RELEASE_NEEDS", "ReleaseNeeds", "WireNeeds"]

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
"""vLLM's NIXL connector package (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``)."""

LEASEKIT_PREFIXES = ("leasekit_", "_leasekit_", "_lk_")
"""Prefixes of every name LeaseKit adds to vLLM's objects (members of its subclasses, connector
metadata attributes, ``kv_transfer_params`` keys); vLLM's source must use none of them."""


@dataclass(frozen=True)
class ClassNeeds:
    """What LeaseKit needs of one vLLM class.

    Attributes:
        module: dotted module LeaseKit imports the class from; name: the class name.
        methods: method name -> parameter names, as ``inspect.signature(getattr(cls, name))`` gives them
            (``self`` kept, ``cls`` of a classmethod dropped; found on the class or a vLLM base).
        attributes: attributes LeaseKit reads, set by the class or a base (``self.x = ...`` in a method,
            a class-level field).
        keyword_calls: methods the class must call on ``self`` only with keyword arguments (LeaseKit's
            override reads them from ``kwargs``).
        writes: method -> names its body must contain (attributes it uses, words of its accounting).
    """

    module: str
    name: str
    methods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    attributes: tuple[str, ...] = ()
    keyword_calls: tuple[str, ...] = ()
    writes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class WireNeeds:
    """One literal of the bytes LeaseKit exchanges with vLLM peers, and where vLLM's source writes it.

    Attributes:
        value: the literal: text (``str``, sent encoded as the release's ``"encoding"`` record) or
            ``bytes``; an f-string format as its template with ``{}`` per field (``"{}:{}"``).
        sites: ``"module:Class.method"`` -> literal forms (:func:`leasekit.vllm.vllmsrc.literal_forms`)
            the method's body (on the class or a vLLM base) must contain; or ``"module:NAME"`` -> ``()``,
            a module-level constant that must equal ``value``.
    """

    value: str | bytes
    sites: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class ReleaseNeeds:
    """Everything LeaseKit needs of one vLLM release.

    Attributes:
        release: e.g. ``"0.33.0"``; classes: the :class:`ClassNeeds`.
        source_modules: the modules whose source the checks read (the classes' own and bases'); every
            site of ``wire`` and ``kv_params`` is in one of them.
        log_formats: module -> log format strings (first argument of a logger call) that
            :mod:`leasekit.telemetry.vllm_log` parses; checked statically, not at import.
        wire: name -> :class:`WireNeeds`: ``heartbeat_prefix``, ``heartbeat_separator``,
            ``completion_format``, ``encoding``, ``handshake_tag``, ``handshake_delimiter``.
        kv_params: ``kv_transfer_params`` key of vLLM's that LeaseKit reads or writes -> the
            ``"module:Class.method"`` sites whose body must use it (a string constant or a keyword
            of ``dict(...)``).
        leasekit_keys: the names LeaseKit adds to vLLM's objects (``kv_transfer_params`` keys, connector
            metadata attributes); no indexed vLLM class may use one (nor a name with a prefix of
            :data:`LEASEKIT_PREFIXES`).
    """

    release: str
    classes: tuple[ClassNeeds, ...]
    source_modules: tuple[str, ...]
    log_formats: Mapping[str, tuple[str, ...]]
    wire: Mapping[str, WireNeeds] = field(default_factory=dict)
    kv_params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    leasekit_keys: tuple[str, ...] = ()


_SELF = ("self",)
_WORKER_INIT = ("self", "vllm_config", "engine_id", "kv_cache_config")
_PROM_INIT = ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")

# Read from vllm 0.32.0 (installed, by import) and vllm 0.33.0 (sdist, by ast): identical for every
# entry below. Sources: nixl/pull_worker.py, base_worker.py, pull_scheduler.py, base_scheduler.py,
# connector.py, stats.py, metadata.py, tp_mapping.py and kv_connector/v1/metrics.py.
_CLASSES_032 = (
    ClassNeeds(f"{NIXL}.pull_worker", "NixlPullConnectorWorker", methods={
        "__init__": _WORKER_INIT, "start_load_kv": ("self", "metadata"), "get_transfer_results": _SELF,
        "_get_new_notifs": _SELF, "_handle_heartbeat": ("self", "payload"),
        "_reap_expired_send_leases": ("self", "done_sending"), "_send_heartbeats": ("self", "metadata"),
        "shutdown": _SELF, "_read_blocks": (
            "self", "read_spec", "dst_engine_id", "request_id", "remote_request_id", "local_xfer_side_handle",
            "local_dram_handle", "remote_xfer_side_handle", "expected_consumers", "awaiting_kvs"),
        "_pop_done_transfers": ("self", "transfers"), "_send_pending_recv_notifs": ("self", "req_id"),
        "get_kv_connector_stats": _SELF,
    }, attributes=(
        "_reqs_to_send", "_reqs_to_process", "_lease_extension", "consumer_notification_counts_by_req",
        "expected_consumer_notifications_by_req", "xfer_stats", "nixl_wrapper", "kv_transfer_config", "tp_rank",
        "engine_id", "_recv_failures", "_recving_metadata", "_recving_transfers", "_remote_agents",
        "kv_caches_base_addr", "_transfer_layer_region_indices", "block_len_per_layer", "block_stride_per_layer",
        "device_type",
    ), keyword_calls=("_read_blocks",),
        # LeaseKit's reaper hands vLLM's the due leases by narrowing self._reqs_to_send for the call
        # (leasekit/vllm/prefill/expiry.py): the method must still reap from that map and do its accounting.
        # _handle_heartbeat is not called by LeaseKit: it is how a stock P parses a LeaseKit D's heartbeats
        writes={"_reap_expired_send_leases": ("_reqs_to_send", "_reqs_to_process", "record_kv_expired_req",
                                              "consumer_notification_counts_by_req")}),
    ClassNeeds(f"{NIXL}.pull_scheduler", "NixlPullConnectorScheduler", methods={
        "__init__": _WORKER_INIT, "request_finished": ("self", "request", "block_ids"),
        "build_connector_meta": ("self", "scheduler_output"), "on_new_request": ("self", "request"),
        "_stop_heartbeat": ("self", "req_id"), "set_xfer_handshake_metadata": ("self", "metadata"),
        # a staticmethod in vLLM; set_xfer_handshake_metadata starts the listener thread with these args
        "_nixl_handshake_listener": ("encoded_data", "ready_event", "stop_event", "host", "port"),
    }, attributes=("_heartbeat_req_engine", "_kv_lease_duration", "_reqs_need_send", "_nixl_handshake_listener_t")),
    ClassNeeds(f"{NIXL}.connector", "NixlPullConnector", methods={
        "__init__": ("self", "vllm_config", "role", "kv_cache_config"), "get_kv_connector_stats": _SELF,
        "build_kv_connector_stats": ("data",), "build_prom_metrics": _PROM_INIT,
    }),
    ClassNeeds(f"{NIXL}.connector", "NixlBaseConnector",
               methods={"__init__": ("self", "vllm_config", "role", "kv_cache_config")}),
    ClassNeeds(f"{NIXL}.stats", "NixlKVConnectorStats", methods={
        "reset": _SELF, "is_empty": _SELF, "aggregate": ("self", "other"),
        "record_notification_after_expiry": _SELF,
    }, attributes=("data",)),
    ClassNeeds(f"{NIXL}.stats", "NixlPromMetrics", methods={
        "__init__": ("self", *_PROM_INIT), "observe": ("self", "transfer_stats_data", "engine_idx"),
    }, attributes=("_counter_cls", "_gauge_cls", "_histogram_cls", "per_engine_labelvalues")),
    ClassNeeds(f"{NIXL}.metadata", "NixlConnectorMetadata",
               attributes=("reqs_to_send", "heartbeat_by_engine", "scheduler_clock")),
    # the values of heartbeat_by_engine: D's fault points copy them and rebind req_ids (decode/heartbeats.py)
    ClassNeeds(f"{NIXL}.metadata", "HeartbeatInfo", attributes=("req_ids",)),
    ClassNeeds(f"{NIXL}.metadata", "ReqMeta", attributes=("remote", "local_block_ids")),
    ClassNeeds(f"{NIXL}.metadata", "RemoteMeta", attributes=("request_id", "engine_id")),
    ClassNeeds(f"{NIXL}.tp_mapping", "ReadSpec", attributes=("remote_rank",)),
    # push mode (LeaseKitPushConnector, leasekit/vllm/push.py): nixl/push_worker.py, push_scheduler.py. The writer
    # thread must still own get_new_notifs, route PUSH_REG by its prefix and forward the rest to the engine thread
    # through _pending_completion_notifs (LeaseKit's tap filters the batch it gets: leasekit/vllm/pushflow.py);
    # get_transfer_results must still pop P's WRITE handles from _sending_transfers into done_sending.
    ClassNeeds(f"{NIXL}.push_worker", "NixlPushConnectorWorker", methods={
        "__init__": _WORKER_INIT, "start_load_kv": ("self", "metadata"), "get_transfer_results": _SELF,
        "_get_new_notifs": _SELF, "_reap_expired_send_leases": ("self", "done_sending"),
        "_send_heartbeats": ("self", "metadata"), "shutdown": _SELF, "_pop_done_transfers": ("self", "transfers"),
        "_xfer_blocks_for_req": ("self", "req_id", "meta"), "get_kv_connector_stats": _SELF,
        "_handle_push_reg_notif": ("self", "notif"),
    }, attributes=(
        "_reqs_to_send", "_reqs_to_process", "_sending_transfers", "_sending_transfers_lock",
        "_pending_completion_notifs", "_recving_metadata", "xfer_stats", "nixl_wrapper", "kv_transfer_config",
        "tp_rank", "engine_id",
        "_failed_recv_reqs",  # D: a withheld registration's receive is failed through it (push.py _lk_withhold_lapsed)
        "_remote_agents", "_handshake_lock",  # D: the P agents a WRITE notification may come from (push.py)
        "_push_writer_wake",  # P: woken when held registrations' hold ends (pushflow.py); D: lease ends (pushend.py)
    ), writes={"_push_writer_loop": ("get_new_notifs", "startswith", "_handle_push_reg_notif",
                                     "_pending_completion_notifs", "_push_writer_wake"),
               "get_transfer_results": ("_pop_done_transfers", "_sending_transfers", "finished_sending")}),
    ClassNeeds(f"{NIXL}.push_scheduler", "NixlPushConnectorScheduler", methods={
        "__init__": _WORKER_INIT, "request_finished": ("self", "request", "block_ids"),
        "build_connector_meta": ("self", "scheduler_output"), "on_new_request": ("self", "request"),
        "_stop_heartbeat": ("self", "req_id"), "set_xfer_handshake_metadata": ("self", "metadata"),
        "_nixl_handshake_listener": ("encoded_data", "ready_event", "stop_event", "host", "port"),
    }, attributes=("_heartbeat_req_engine", "_kv_lease_duration", "_reqs_need_send", "_nixl_handshake_listener_t")),
    ClassNeeds(f"{NIXL}.connector", "NixlPushConnector", methods={
        "__init__": ("self", "vllm_config", "role", "kv_cache_config"), "get_kv_connector_stats": _SELF,
        "build_kv_connector_stats": ("data",), "build_prom_metrics": _PROM_INIT,
    }),
)

_SOURCE_MODULES = (*(f"{NIXL}.{m}" for m in ("base_worker", "pull_worker", "base_scheduler", "pull_scheduler",
                                                 "connector", "metadata", "stats", "tp_mapping", "push_worker",
                                                 "push_scheduler")),
                   "vllm.distributed.kv_transfer.kv_connector.v1.metrics")

_LOG_FORMATS_032 = MappingProxyType({
    f"{NIXL}.pull_scheduler": ("NIXLConnector request_finished(%s) waiting for %d seconds before releasing blocks",),
    # push mode's grant line (vLLM's NixlPushConnector; the stock push target's evidence)
    f"{NIXL}.push_scheduler": ("NixlPushConnector request_finished(%s) waiting for %d seconds before releasing blocks",),
    f"{NIXL}.base_worker": (
        "Heartbeat extended lease for request %s by %ds (old_expiry=%.1f, new_expiry=%.1f)",
        "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease expired.",
        "Initializing NIXL worker %s"),
    f"{NIXL}.pull_worker": ("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode "
                            "worker. They may have expired.",),
    f"{NIXL}.base_scheduler": ("Initializing NIXL Scheduler %s",),
    "vllm.v1.core.sched.scheduler": ("Finished sending KV transfer for request %s",),
})

_WORKER = f"{NIXL}.pull_worker:NixlPullConnectorWorker"
_SCHEDULER = f"{NIXL}.pull_scheduler:NixlPullConnectorScheduler"

# D sends a heartbeat as ("HB:" + ",".join(ids)).encode() (base_worker.py _send_heartbeats) and a read
# completion as f"{remote_request_id}:{expected_consumers}".encode() (pull_worker.py _read_blocks; also
# _read_blocks_for_req's MLA path); P decodes with notif.decode("utf-8"), msg.startswith("HB:"), msg[3:] split on
# "," (base_worker.py _handle_heartbeat) and msg.rsplit(":", 1) (pull_worker.py _get_new_notifs).
# LeaseKit's codec (leasekit/lease/codec.py) and notification tap (leasekit/vllm/taps.py) speak the same.
# The handshake request is msgpack((GET_META_MSG, pp_rank, tp_rank)) (metadata.py); the listener
# (base_scheduler.py _nixl_handshake_listener) replies [identity, b"", payload, msgpack(perf_counter)], as
# LeaseKit's listener does (leasekit/vllm/prefill/listener.py).
_WIRE_032 = MappingProxyType({
    "heartbeat_prefix": WireNeeds("HB:", {f"{_WORKER}._send_heartbeats": ("'HB:'", ".encode()"),
                                          f"{_WORKER}._get_new_notifs": (".startswith('HB:')", "[3:]")}),
    "heartbeat_separator": WireNeeds(",", {f"{_WORKER}._send_heartbeats": ("','.join",),
                                           f"{_WORKER}._handle_heartbeat": (".split(',')",)}),
    "completion_format": WireNeeds("{}:{}", {f"{_WORKER}._read_blocks": ("f'{}:{}'", ".encode()"),
                                             f"{_WORKER}._read_blocks_for_req": ("f'{}:{}'",),
                                             f"{_WORKER}._get_new_notifs": (".rsplit(':', 1)",)}),
    "encoding": WireNeeds("utf-8", {f"{_WORKER}._get_new_notifs": (".decode('utf-8')",)}),
    "handshake_tag": WireNeeds(b"get_meta_msg", {f"{NIXL}.metadata:GET_META_MSG": ()}),
    "handshake_delimiter": WireNeeds(b"", {f"{_SCHEDULER}._nixl_handshake_listener": ("b''", ".recv_multipart()")}),
    # push mode: D's registration is PUSH_REG_NOTIF_PREFIX + msgpack(dict) (push_worker.py _do_send_reg_notif);
    # LeaseKit's guard (leasekit/lease/pushreg.py) recognises and decodes it the same way
    "push_reg_prefix": WireNeeds(b"PUSH_REG:", {f"{NIXL}.metadata:PUSH_REG_NOTIF_PREFIX": ()}),
})

# P's request_finished returns them (dict(...) in pull_scheduler.py); D's on_new_request reads them
# (base_scheduler.py) and tracks a request for heartbeats only with every remote field set (the rule
# leasekit/lease/tracker.py models). LeaseKit's P reads do_remote_prefill of the params it returns, its D
# reads do_remote_prefill, remote_engine_id and remote_host of a new request (leasekit/vllm/scheduler.py);
# the router sends P do_remote_decode and do_remote_prefill and reads remote_request_id
# (leasekit/cluster/router.py).
_PARAM_SITES = (f"{_SCHEDULER}.request_finished", f"{_SCHEDULER}.on_new_request")
_KV_PARAMS_032 = MappingProxyType({key: _PARAM_SITES for key in (
    "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
    "tp_size")})

# LeaseKit's kv_transfer_params keys (leasekit/lease/codec.py, pledge.py) and the connector metadata
# attributes its scheduler sets (leasekit/vllm/scheduler.py METADATA_*_ATTR).
_LEASEKIT_KEYS = (PROTOCOL_PARAM, PLEDGE_PARAM, "leasekit_kv_blocks", "leasekit_trace_headers", "leasekit_tracked",
                  "leasekit_untracked", "leasekit_protected", "leasekit_finished", "leasekit_kv_block_ids",
                  "leasekit_pledges", "leasekit_pledge_clock", TOKEN_PARAM, "leasekit_lease_key",
                  "leasekit_side_channel_peers")

_NEEDS_032 = dict(wire=_WIRE_032, kv_params=_KV_PARAMS_032, leasekit_keys=_LEASEKIT_KEYS)

RELEASE_NEEDS: Mapping[str, ReleaseNeeds] = MappingProxyType({
    "0.32.0": ReleaseNeeds("0.32.0", _CLASSES_032, _SOURCE_MODULES, _LOG_FORMATS_032, **_NEEDS_032),
    # 0.33.0 changed none of these (its NIXL changes LeaseKit does not touch: docs/chaos.md, "Supported
    # vLLM releases"); recorded separately so that a later release can differ.
    "0.33.0": ReleaseNeeds("0.33.0", _CLASSES_032, _SOURCE_MODULES, _LOG_FORMATS_032, **_NEEDS_032),
})
"""What LeaseKit needs of each release of :data:`~leasekit.lease.releases.SUPPORTED_VLLM_RELEASES`."""
