"""Version guard: LeaseKitConnector hooks private methods and reads private attributes of vLLM's
NixlConnector, so it only loads on the releases it was checked against, and checks at import that
the installed vLLM still has each hook with the recorded signature and each attribute.

What LeaseKit needs of vLLM is recorded per release (:data:`RELEASE_NEEDS`): for each vLLM class,
the methods it overrides or calls with their parameter names (as :func:`inspect.signature` gives
them), the instance attributes it reads, the methods vLLM must call with keywords only, the
``kv_transfer_params`` keys P's ``request_finished`` must write; and the log formats the stock-log
parser reads (:mod:`leasekit.telemetry.vllm_log`). At import (:func:`check_installed`) signatures are
read with :mod:`inspect` and the rest from the installed ``.py`` files with :mod:`ast`
(:mod:`leasekit.vllm.vllmsrc`: attributes exist only after ``__init__``). The same records are
checked statically against a release's source distribution (:func:`check_source`;
tests/unit/test_vllm_033_static.py for 0.33.0, which is CUDA only and cannot be imported here).

No vLLM import at module level (``leasekit.vllm`` must import without vLLM).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from leasekit.lease.releases import INSTALL_COMMANDS, SUPPORTED_VLLM_RELEASES, release_of
from leasekit.vllm.vllmsrc import SourceIndex, index_modules, param_names, read_modules

__all__ = ["ALLOW_UNSUPPORTED_ENV", "ClassNeeds", "RELEASE_NEEDS", "ReleaseNeeds", "SUPPORTED_VLLM_RELEASES",
           "UnsupportedVllmError", "check_hooks", "check_installed", "check_source", "check_vllm_release",
           "needs_for", "signature_problems"]

ALLOW_UNSUPPORTED_ENV = "LEASEKIT_ALLOW_UNSUPPORTED_VLLM"

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
"""vLLM's NIXL connector package (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``)."""


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
        writes: method -> names its body must contain (keys of a ``dict(...)`` it returns, attributes it uses).
    """

    module: str
    name: str
    methods: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    attributes: tuple[str, ...] = ()
    keyword_calls: tuple[str, ...] = ()
    writes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseNeeds:
    """Everything LeaseKit needs of one vLLM release.

    Attributes:
        release: e.g. ``"0.33.0"``; classes: the :class:`ClassNeeds`.
        source_modules: the modules whose source the attribute checks read (the classes' own and bases').
        log_formats: module -> log format strings (first argument of a logger call) that
            :mod:`leasekit.telemetry.vllm_log` parses; checked statically, not at import.
    """

    release: str
    classes: tuple[ClassNeeds, ...]
    source_modules: tuple[str, ...]
    log_formats: Mapping[str, tuple[str, ...]]


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
        # (leasekit/vllm/connector.py): the method must still reap from that map and do its accounting
        writes={"_reap_expired_send_leases": ("_reqs_to_send", "_reqs_to_process", "record_kv_expired_req",
                                              "consumer_notification_counts_by_req")}),
    ClassNeeds(f"{NIXL}.pull_scheduler", "NixlPullConnectorScheduler", methods={
        "__init__": _WORKER_INIT, "request_finished": ("self", "request", "block_ids"),
        "build_connector_meta": ("self", "scheduler_output"), "on_new_request": ("self", "request"),
        "_stop_heartbeat": ("self", "req_id"), "set_xfer_handshake_metadata": ("self", "metadata"),
        # a staticmethod in vLLM; set_xfer_handshake_metadata starts the listener thread with these args
        "_nixl_handshake_listener": ("encoded_data", "ready_event", "stop_event", "host", "port"),
    }, attributes=("_heartbeat_req_engine", "_kv_lease_duration", "_reqs_need_send", "_nixl_handshake_listener_t"),
        writes={"request_finished": ("do_remote_prefill", "remote_engine_id", "remote_host")}),
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
    ClassNeeds(f"{NIXL}.metadata", "ReqMeta", attributes=("remote", "local_block_ids")),
    ClassNeeds(f"{NIXL}.metadata", "RemoteMeta", attributes=("request_id",)),
    ClassNeeds(f"{NIXL}.tp_mapping", "ReadSpec", attributes=("remote_rank",)),
)

_SOURCE_MODULES = (*(f"{NIXL}.{m}" for m in ("base_worker", "pull_worker", "base_scheduler", "pull_scheduler",
                                                 "connector", "metadata", "stats", "tp_mapping")),
                   "vllm.distributed.kv_transfer.kv_connector.v1.metrics")

_LOG_FORMATS_032 = MappingProxyType({
    f"{NIXL}.pull_scheduler": ("NIXLConnector request_finished(%s) waiting for %d seconds before releasing blocks",),
    f"{NIXL}.base_worker": (
        "Heartbeat extended lease for request %s by %ds (old_expiry=%.1f, new_expiry=%.1f)",
        "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease expired.",
        "Initializing NIXL worker %s"),
    f"{NIXL}.pull_worker": ("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode "
                            "worker. They may have expired.",),
    f"{NIXL}.base_scheduler": ("Initializing NIXL Scheduler %s",),
    "vllm.v1.core.sched.scheduler": ("Finished sending KV transfer for request %s",),
})

RELEASE_NEEDS: Mapping[str, ReleaseNeeds] = MappingProxyType({
    "0.32.0": ReleaseNeeds("0.32.0", _CLASSES_032, _SOURCE_MODULES, _LOG_FORMATS_032),
    # 0.33.0 changed none of these (its NIXL changes LeaseKit does not touch: docs/chaos.md, "Supported
    # vLLM releases"); recorded separately so that a later release can differ.
    "0.33.0": ReleaseNeeds("0.33.0", _CLASSES_032, _SOURCE_MODULES, _LOG_FORMATS_032),
})
"""What LeaseKit needs of each release of :data:`SUPPORTED_VLLM_RELEASES`."""


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a release LeaseKitConnector supports, or lacks a hook, signature or
    attribute it needs; the message names them and the fix."""


def _supported_text() -> str:
    return ", ".join(SUPPORTED_VLLM_RELEASES)


def check_vllm_release(version: str, *, allow_unsupported: bool | None = None) -> None:
    """Refuse an unsupported vLLM release.

    Args:
        version: ``vllm.__version__`` (a local part such as ``+cpu`` is ignored).
        allow_unsupported: skip the check; defaults to env ``LEASEKIT_ALLOW_UNSUPPORTED_VLLM=1``
            (at your own risk: private hooks may have changed meaning; :func:`check_installed` then
            checks against the newest supported release's records).

    Raises:
        UnsupportedVllmError: ``version`` is not in :data:`SUPPORTED_VLLM_RELEASES`.
    """
    if allow_unsupported is None:
        allow_unsupported = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") == "1"
    if allow_unsupported or release_of(version) in SUPPORTED_VLLM_RELEASES:
        return
    installs = "; ".join(f"{r}: {INSTALL_COMMANDS[r]}" for r in SUPPORTED_VLLM_RELEASES)
    raise UnsupportedVllmError(
        f"LeaseKitConnector does not support vLLM {version}; supported releases: {_supported_text()}. "
        f"Fix: install one of them ({installs}), or use the stock NixlConnector. "
        f"{ALLOW_UNSUPPORTED_ENV}=1 skips this check at your own risk."
    )


def needs_for(version: str) -> ReleaseNeeds:
    """The records of ``version``'s release; the newest supported release's for any other version
    (what :func:`check_installed` holds an allowed unsupported release to)."""
    return RELEASE_NEEDS.get(release_of(version), RELEASE_NEEDS[SUPPORTED_VLLM_RELEASES[-1]])


def check_hooks(cls: type, names: tuple[str, ...]) -> None:
    """Check that ``cls`` still has every method in ``names`` (callable attributes).

    Raises:
        UnsupportedVllmError: a hook is missing (vLLM internals changed); the message names it.
    """
    missing = [name for name in names if not callable(getattr(cls, name, None))]
    if missing:
        raise UnsupportedVllmError(
            f"vLLM's {cls.__name__} lacks {', '.join(missing)}: its internals changed. "
            f"Supported vLLM releases: {_supported_text()}."
        )


def signature_problems(cls: type, needs: ClassNeeds) -> list[str]:
    """Each method of ``needs`` that ``cls`` lacks or whose parameter names differ, as
    ``"Class.method: ..."`` (read with :func:`inspect.signature`); empty when all match."""
    problems = []
    for name, expected in needs.methods.items():
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{needs.name}.{name}: missing")
            continue
        try:
            found = param_names(method)
        except (TypeError, ValueError) as exc:
            problems.append(f"{needs.name}.{name}: no signature ({exc})")
            continue
        if found != tuple(expected):
            problems.append(f"{needs.name}.{name}: parameters ({', '.join(found)}), expected ({', '.join(expected)})")
    return problems


def check_source(index: SourceIndex, needs: ReleaseNeeds, *, methods: bool = True, logs: bool = False) -> list[str]:
    """Check ``needs`` against vLLM source read with :func:`leasekit.vllm.vllmsrc.index_modules`.

    Args:
        index: the indexed modules (at least ``needs.source_modules``; with ``logs`` also the modules
            of ``needs.log_formats``).
        methods: check method presence and parameter names (by :mod:`ast`); the import-time guard
            checks them with :mod:`inspect` instead and passes False.
        logs: check the log formats too.

    Returns:
        One ``"Class.member: ..."`` (or ``"module: ..."``) line per problem; empty when all is there.
    """
    problems: list[str] = []
    for cls in needs.classes:
        try:
            have = index.attributes(cls.name, cls.module)
        except KeyError as exc:
            problems.append(f"{cls.name}: not found in {cls.module} ({exc.args[0]})")
            continue
        if methods:
            for name, expected in cls.methods.items():
                found = index.method(cls.name, name, cls.module)
                if found is None:
                    problems.append(f"{cls.name}.{name}: missing")
                elif found[1] != tuple(expected):
                    problems.append(f"{cls.name}.{name} (on {found[0]}): parameters ({', '.join(found[1])}), "
                                    f"expected ({', '.join(expected)})")
        problems += [f"{cls.name}.{a}: attribute never set" for a in cls.attributes if a not in have]
        own = index.mro(cls.name, cls.module)
        for name in cls.keyword_calls:
            if not any(name in c.self_calls for c in own):
                problems.append(f"{cls.name}: never calls self.{name}(...) (expected keyword-only calls)")
            elif any(name in c.positional_calls for c in own):
                problems.append(f"{cls.name}: calls self.{name}(...) with positional arguments (LeaseKit reads "
                                "them by keyword)")
        for method, words in cls.writes.items():
            body = next((c.method_words[method] for c in own if method in c.method_words), frozenset())
            problems += [f"{cls.name}.{method}: no longer writes {w!r}" for w in words if w not in body]
    if logs:
        for module, formats in needs.log_formats.items():
            have_logs = index.log_formats.get(module)
            if have_logs is None:
                problems.append(f"{module}: not indexed (log formats unchecked)")
                continue
            problems += [f"{module}: no log call with format {f!r}" for f in formats if f not in have_logs]
    return problems


def check_installed(version: str, *, source_root: Path | None = None) -> None:
    """The import-time guard: the installed vLLM has every hook with its recorded signature
    (:mod:`inspect`) and every attribute, keyword-only call and ``kv_transfer_params`` key
    (:mod:`ast` over its ``.py`` files) that :func:`needs_for` ``(version)`` records.

    Args:
        version: ``vllm.__version__``.
        source_root: the directory holding the ``vllm`` package; defaults to the imported one's.

    Raises:
        UnsupportedVllmError: anything missing or different (every problem listed, with the fix);
            also when vLLM's source files cannot be read or parsed.
    """
    needs = needs_for(version)
    problems: list[str] = []
    for cls in needs.classes:
        obj = getattr(importlib.import_module(cls.module), cls.name, None)
        if not isinstance(obj, type):
            problems.append(f"{cls.module}.{cls.name}: missing")
            continue
        problems += signature_problems(obj, cls)
    if source_root is None:
        source_root = Path(importlib.import_module("vllm").__file__).resolve().parent.parent
    try:
        problems += check_source(index_modules(read_modules(source_root, needs.source_modules)), needs, methods=False)
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        problems.append(f"cannot read vLLM's source to check attributes: {exc}")
    if problems:
        raise UnsupportedVllmError(
            f"vLLM {version} differs from what LeaseKitConnector was checked against (vLLM {needs.release}): "
            + "; ".join(problems)
            + f". Fix: install a supported release ({_supported_text()}) from its official package, or use "
              "the stock NixlConnector."
        )
