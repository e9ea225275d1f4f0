"""Build vLLM 0.32.0's stock NIXL pull worker and LeaseKit's worker as the engine holds them, without a
NIXL agent or a device.

The engine's worker process holds a *connector* (``NixlPullConnector`` or ``LeaseKitConnector``, role
``WORKER``) whose ``connector_worker`` does the work; the scheduler process holds the same connector
class in role ``SCHEDULER``. Here (paths relative to
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

- scheduler side: the real connector, built by its own ``__init__`` with ``KVConnectorRole.SCHEDULER``
  (no thread, no socket until ``set_xfer_handshake_metadata``), from a real ``VllmConfig`` of a tiny
  local Llama config (no download) on the CPU device;
- worker side: ``object.__new__(NixlPullConnectorWorker)`` or ``object.__new__(LeaseKitPullWorker)``.
  The real ``__init__`` (``base_worker.py:505-923``) creates a NIXL agent, reads the attention backend
  and the TP group, which need a device. :func:`set_stock_attributes` sets exactly the attributes the
  per-step paths read, with the value ``__init__`` gives them (line cited per attribute), and a
  :class:`FakeNixlWrapper` (``get_new_notifs``/``send_notif``) stands in for the NIXL agent. For
  LeaseKit, :func:`make_leasekit_worker` then calls ``_lk_setup(engine_id)``, LeaseKit's part of its
  ``__init__``. Nothing else of LeaseKit is touched, so the builders survive refactors of its internals.
- the worker-role connector: ``object.__new__(cls)`` plus ``NixlBaseConnector.__init__`` (what both
  connectors' ``__init__`` run for ``WORKER``, ``connector.py``), with our worker as ``connector_worker``.

The tiny-Llama helpers mirror ``tests/vllm_replay.py``; they are repeated here, not imported, because
that module imports LeaseKit internals (``leasekit.lease``) that are refactored independently.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import threading
from collections import defaultdict, deque
from types import SimpleNamespace
from typing import Any, Iterator, Mapping

NIXL_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
LEASEKIT_MODULE = "leasekit.vllm.connector"
BLOCK_SIZE = 16
LEASE_DURATION_S = 30  # vLLM's default kv_lease_duration (base_worker.py:528-530)
P_ENGINE = "bench-prefill-engine"
D_ENGINE = "bench-decode-engine"
P_AGENT = "bench-prefill-agent-tp0"  # P's NIXL agent name (D's _remote_agents value after the handshake)
D_AGENT = "bench-decode-agent-tp0"  # the D worker whose notifications P receives

# Environment variables that would change what LeaseKit's telemetry exports (OpenTelemetry spec,
# "SDK Environment Variables" and "OTLP Exporter Configuration"; leasekit/vllm/faultpoints.py).
OTLP_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
SDK_DISABLED_ENV = "OTEL_SDK_DISABLED"
FAULT_FILE_ENV = "LEASEKIT_FAULT_FILE"


def load_vllm() -> SimpleNamespace:
    """Import vLLM's pieces the builders use, and LeaseKit's connector module.

    Raises:
        ImportError: vLLM (or LeaseKit's connector, which checks the vLLM release at import) is missing.
    """
    nixl = {name: importlib.import_module(f"{NIXL_PKG}.{name}") for name in (
        "base_worker", "pull_worker", "connector", "metadata", "stats")}
    import vllm
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus

    leasekit = importlib.import_module(LEASEKIT_MODULE)
    return SimpleNamespace(
        version=vllm.__version__, **nixl, leasekit=leasekit,
        CacheConfig=CacheConfig, DeviceConfig=DeviceConfig, KVTransferConfig=KVTransferConfig,
        ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig,
        KVConnectorRole=KVConnectorRole, SamplingParams=SamplingParams, KVCacheBlocks=KVCacheBlocks,
        SchedulerOutput=SchedulerOutput, KVConnectorOutput=KVConnectorOutput,
        Request=Request, RequestStatus=RequestStatus,
    )


def make_vllm_config(v: SimpleNamespace, model_dir: str, *, leasekit: bool, kv_role: str, engine_id: str,
                     run_dir: str | None = None):
    """A real ``VllmConfig`` for the tiny local Llama (CPU device) with ``NixlConnector`` (stock) or
    ``LeaseKitConnector`` (``kv_connector_extra_config``: ``kv_lease_duration`` 30 s and
    ``leasekit_run_dir`` ``run_dir``, the span directory). ``kv_role``: ``kv_producer`` (P) or
    ``kv_consumer`` (D)."""
    extra: dict[str, Any] = {"kv_lease_duration": LEASE_DURATION_S}
    if leasekit:
        extra["leasekit_run_dir"] = run_dir
    model_config = v.ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True)
    return v.VllmConfig(
        model_config=model_config,
        scheduler_config=v.SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, max_model_len=1024,
            is_encoder_decoder=model_config.is_encoder_decoder),
        cache_config=v.CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=v.KVTransferConfig(
            kv_connector="LeaseKitConnector" if leasekit else "NixlConnector",
            kv_connector_module_path=LEASEKIT_MODULE if leasekit else None,
            kv_role=kv_role, engine_id=engine_id, kv_connector_extra_config=extra),
        device_config=v.DeviceConfig("cpu"),
    )


def make_kv_cache_config(v: SimpleNamespace):
    """A one-group full-attention ``KVCacheConfig`` (1000 blocks of ``BLOCK_SIZE`` tokens)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=1000, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])


def make_request(v: SimpleNamespace, req_id: str, kv_transfer_params: dict[str, Any] | None):
    """A real ``vllm.v1.request.Request`` with a 2-block prompt and these ``kv_transfer_params``."""
    req = v.Request(request_id=req_id, prompt_token_ids=list(range(1, 2 * BLOCK_SIZE + 1)),
                    sampling_params=v.SamplingParams(max_tokens=1), pooling_params=None)
    req.kv_transfer_params = kv_transfer_params
    return req


class FakeNixlWrapper:
    """Stands in for ``NixlWrapper`` (``base_worker.py:644``): an inbox the benchmark fills
    (``deliver``), drained by ``get_new_notifs`` as NIXL drains its notifications; ``send_notif``
    counts sends and keeps the last ``keep`` of them (``sent``: ``(agent, bytes)``)."""

    def __init__(self, name: str, keep: int = 64) -> None:
        self.name = name
        self.inbox: dict[str, list[bytes]] = {}
        self.sent: deque[tuple[str, bytes]] = deque(maxlen=keep)
        self.sent_count = 0

    def deliver(self, agent: str, messages: list[bytes]) -> None:
        """Queue ``messages`` (raw notification bytes) from NIXL agent ``agent``."""
        self.inbox.setdefault(agent, []).extend(messages)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """NIXL's ``get_new_notifs``: ``{agent: [bytes]}`` received since the last call."""
        out, self.inbox = self.inbox, {}
        return out

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        """NIXL's ``send_notif``: recorded, never fails."""
        self.sent_count += 1
        self.sent.append((agent_name, bytes(notif_msg)))


class FakeTopology:
    """Stands in for ``TransferTopology`` (``base_worker.py:869``, set by ``register_kv_caches``):
    ``get_transfer_results`` and ``_get_new_notifs`` only assert it is set."""

    def get_engine_info(self, engine_id: str) -> SimpleNamespace:
        return SimpleNamespace(remote_block_size=BLOCK_SIZE, remote_physical_blocks_per_logical=1)

    def block_size_ratio(self, remote_block_size: int) -> int:
        return 1


def set_stock_attributes(w: Any, v: SimpleNamespace, vllm_config, engine_id: str, agent_name: str) -> FakeNixlWrapper:
    """Give ``w`` (made by ``object.__new__``) the attributes vLLM 0.32.0's per-step worker paths read
    (``start_load_kv``, ``_send_heartbeats``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
    ``get_kv_connector_stats``, ``shutdown``), valued as ``NixlBaseConnectorWorker.__init__`` sets them
    on a CPU TP1 engine (``base_worker.py`` line per attribute). Returns the fake NIXL wrapper."""
    kv_transfer_config = vllm_config.kv_transfer_config
    wrapper = FakeNixlWrapper(agent_name)
    w.vllm_config = vllm_config  # :519
    w.kv_transfer_config = kv_transfer_config  # :523
    w._lease_extension = kv_transfer_config.get_from_extra_config("kv_lease_duration", 30) * 2 // 3  # :528-532
    w._bidirectional_kv_xfer_enabled = False  # :534-538
    w._is_hma_required = False  # :560-566 (one full-attention group)
    w._has_mamba = False  # :574
    w.nixl_wrapper = wrapper  # :644 (NixlWrapper(uuid, config))
    w._remote_agents = defaultdict(dict)  # :647-649
    w._failed_remote_engines = set()  # :651
    w._invalid_remote_engines = set()  # :652
    w._invalid_engine_backoff = {}  # :655
    w._engine_clock_offset = {}  # :657
    w.engine_id = engine_id  # :660
    w.tp_rank = 0  # :661 (get_tensor_model_parallel_rank())
    w.world_size = 1  # :662
    w.pcp_size = w.dcp_size = 1  # :663-664
    w.pcp_rank = 0  # :665
    w.pcp_dcp_sharded = False  # :668
    w.dcp_rank = 0  # :675
    w.enable_permute_local_kv = False  # :678
    w.enable_heterogeneous_attn_post_process = False  # :679
    w.use_host_buffer = False  # :697 (device_type cpu)
    w.copy_blocks = None  # :732
    w._hb_handshake_notif_only = False  # :781
    w.src_xfer_handles_by_block_size = {}  # :784
    w.src_xfer_handles_by_tp_ratio = {}  # :790
    w._dram_src_handles_by_tp_ratio = {}  # :791
    w._dram_src_handles_by_block_size = {}  # :754
    w._registered_descs = []  # :802
    w._recving_metadata = {}  # :806
    w._recving_transfers = defaultdict(list)  # :807
    w._reqs_to_send = {}  # :809
    w._replicated_pcp_done_sending = set()  # :812
    w._reqs_to_process = set()  # :814
    w._invalid_block_ids = queue.Queue()  # :817
    w._failed_recv_reqs = queue.Queue()  # :821
    w._recv_failures = set()  # :822
    w._pending_recv_notifs = {}  # :823
    w._ready_requests = queue.Queue()  # :833
    w._handshake_futures = {}  # :834-836
    w._handshake_lock = threading.RLock()  # :838
    w._engine_last_active = {}  # :841
    w._engine_ttl = kv_transfer_config.get_from_extra_config("engine_ttl", 3600.0)  # :842-844
    w._engine_by_address = {}  # :846
    w.transfer_topo = FakeTopology()  # :869 None, set at :1368 by register_kv_caches
    w.consumer_notification_counts_by_req = defaultdict(int)  # :873
    w.expected_consumer_notifications_by_req = {}  # :874
    w.xfer_stats = v.stats.NixlKVConnectorStats()  # :875
    w._physical_blocks_per_logical_kv_block = 1  # :877
    w.device_kv_caches = {}  # :691
    w.host_xfer_buffers = {}  # :695
    return w.nixl_wrapper


def make_stock_worker(v: SimpleNamespace, vllm_config, engine_id: str, agent_name: str):
    """``(worker, wrapper)``: vLLM's ``NixlPullConnectorWorker`` without ``__init__`` (see module docstring)."""
    w = object.__new__(v.pull_worker.NixlPullConnectorWorker)
    return w, set_stock_attributes(w, v, vllm_config, engine_id, agent_name)


@contextlib.contextmanager
def telemetry_env(export: bool, extra: Mapping[str, str | None] | None = None) -> Iterator[None]:
    """The process environment while a LeaseKit worker is built: OTLP endpoints and chaos fault points
    unset; with ``export`` False, ``OTEL_SDK_DISABLED=true`` (OpenTelemetry's standard switch: the
    SDK's ``TracerProvider`` then hands out no-op tracers, so no span is recorded nor exported); then
    ``extra`` applied (name -> value; None unsets). Restored on exit (the SDK reads it once, when the
    provider is made)."""
    names = (*OTLP_ENV, SDK_DISABLED_ENV, FAULT_FILE_ENV, *(extra or {}))
    saved = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            os.environ.pop(name, None)
        if not export:
            os.environ[SDK_DISABLED_ENV] = "true"
        os.environ.update({name: value for name, value in (extra or {}).items() if value is not None})
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_leasekit_worker(v: SimpleNamespace, vllm_config, engine_id: str, agent_name: str, *, export: bool = True,
                         extra_env: Mapping[str, str | None] | None = None):
    """``(worker, wrapper)``: ``LeaseKitPullWorker`` with the stock attributes set as vLLM's ``__init__``
    would, then LeaseKit's ``_lk_setup(engine_id)`` (it reads ``kv_transfer_config``, ``tp_rank`` and
    ``nixl_wrapper``, which it wraps). ``export``, ``extra_env``: see :func:`telemetry_env`.

    Raises:
        whatever ``_lk_setup`` raises for a bad configuration (LeaseKit's config errors)."""
    w = object.__new__(v.leasekit.LeaseKitPullWorker)
    wrapper = set_stock_attributes(w, v, vllm_config, engine_id, agent_name)
    with telemetry_env(export, extra_env):
        w._lk_setup(engine_id)
    return w, wrapper


def worker_connector(v: SimpleNamespace, connector_cls: type, vllm_config, kv_cache_config, worker: Any):
    """The worker-role connector the model runner calls (``get_kv_transfer_group()``): what
    ``NixlPullConnector.__init__`` / ``LeaseKitConnector.__init__`` do for ``KVConnectorRole.WORKER``
    (``NixlBaseConnector.__init__``, then ``connector_worker``), with ``worker`` instead of a new one."""
    connector = object.__new__(connector_cls)
    v.connector.NixlBaseConnector.__init__(connector, vllm_config, v.KVConnectorRole.WORKER, kv_cache_config)
    connector.connector_scheduler = None
    connector.connector_worker = worker
    return connector


def scheduler_connector(v: SimpleNamespace, connector_cls: type, vllm_config, kv_cache_config):
    """The scheduler-role connector, built by its own ``__init__`` (``KVConnectorRole.SCHEDULER``)."""
    return connector_cls(vllm_config, v.KVConnectorRole.SCHEDULER, kv_cache_config)


def connector_classes(v: SimpleNamespace, leasekit: bool) -> type:
    """``LeaseKitConnector`` or vLLM's ``NixlPullConnector`` (alias ``NixlConnector``)."""
    return v.leasekit.LeaseKitConnector if leasekit else v.connector.NixlPullConnector
