"""How to launch one vLLM OpenAI server (prefill or decode): :class:`ServerSpec`, its vLLM flags
and its ``--kv-transfer-config`` (LeaseKitConnector or vLLM's stock NixlConnector).
:class:`leasekit.cluster.server.VllmServer` runs it on this host,
:class:`leasekit.cluster.remote.RemoteVllmServer` on another one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from leasekit.vllm import (
    CONNECTOR_MODULE_PATH,
    CONNECTOR_NAME,
    STOCK_CONNECTOR_NAME,
    PUSH_CONNECTOR_NAME,
    STOCK_PUSH_CONNECTOR_NAME,
    TRANSFER_MODES,
)

Role = Literal["prefill", "decode"]
ConnectorKind = Literal["leasekit", "stock"]
SERVED_MODEL_NAME = "leasekit-tiny"
"""``--served-model-name`` of every server (the model name the router sends)."""
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
"""vLLM's ``kv_role`` of each role (``--kv-transfer-config``)."""


@dataclass
class ServerSpec:
    """How to launch one server.

    Attributes:
        name: label used for the log file and reports (e.g. ``"prefill"``).
        role: ``prefill`` (kv_producer) or ``decode`` (kv_consumer).
        connector: ``leasekit`` (LeaseKitConnector, or LeaseKitPushConnector when ``transfer_mode`` is ``push``) or
            ``stock`` (vLLM's NixlConnector, or its NixlPushConnector in push mode).
        model_dir: directory holding the model ``config.json``, or a Hugging Face model id.
        lease_duration_s: ``kv_lease_duration`` in seconds.
        cpu: core (or tuple of cores) to pin the whole server to; None leaves it unpinned.
        max_num_seqs: vLLM ``--max-num-seqs`` (1 on D makes a waiting queue easy to build).
        max_model_len: vLLM ``--max-model-len`` in tokens.
        kv_cache_bytes: vLLM ``--kv-cache-memory-bytes``; None leaves it out (GPU: sized from memory utilization).
        http_port / side_channel_port: 0 picks a free port at start.
        extra_env: extra environment variables.
        extra_args: extra CLI arguments for the API server.
        command_prefix: wrappers the server is launched under (``unshare --time ...``,
            ``ip netns exec NAME``), outermost first.
        bind_host / url_host: where the server listens and where clients reach it (a network
            namespace binds 0.0.0.0 and is reached on its veth address).
        connector_extra: extra ``kv_connector_extra_config`` entries for LeaseKitConnector (e.g.
            ``{"leasekit_max_hold_s": 10}``); ignored for the stock connector.
        kv_load_failure_policy: vLLM's ``kv_load_failure_policy`` (``recompute`` or ``fail``; None keeps
            vLLM's default, ``fail``): what D does with a read that failed or that LeaseKit discarded.
        device (``cpu``/``cuda``), load_format, skip_tokenizer_init, dtype, gpu_memory_utilization (0-1],
            tensor_parallel_size (given always on cuda): vLLM's flags; None leaves one out (vLLM's
            default, for a real model); the defaults are the tiny model's (``dummy``, no tokenizer, float32).
        cuda_visible_devices: GPU indices for ``CUDA_VISIBLE_DEVICES`` (None: inherited); kv_buffer_device:
            the kv-transfer-config's (``cpu``/``cuda``; None: vLLM's); side_channel_host: this server's NIXL
            side-channel address (``VLLM_NIXL_SIDE_CHANNEL_HOST``): D dials P's for the handshake, and in
            push mode P dials D's (sent in D's ``PUSH_REG``) before it WRITEs.
    """

    name: str
    role: Role
    connector: ConnectorKind
    model_dir: Path
    lease_duration_s: float = 30
    cpu: int | tuple[int, ...] | None = None
    max_num_seqs: int = 8
    max_model_len: int = 4096
    kv_cache_bytes: int | None = 64 * 1024 * 1024
    http_port: int = 0
    side_channel_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    command_prefix: list[str] = field(default_factory=list)
    bind_host: str = "127.0.0.1"
    url_host: str = "127.0.0.1"
    connector_extra: dict[str, object] = field(default_factory=dict)
    kv_load_failure_policy: str | None = None
    device: Literal["cpu", "cuda"] = "cpu"
    load_format: str | None = "dummy"
    skip_tokenizer_init: bool = True
    dtype: str | None = "float32"
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    cuda_visible_devices: list[int] | None = None
    kv_buffer_device: str | None = None
    side_channel_host: str = "127.0.0.1"
    transfer_mode: str = "pull"

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"role must be one of {sorted(KV_ROLES)}, got {self.role!r}")
        if self.connector not in ("leasekit", "stock"):
            raise ValueError(f"connector must be 'leasekit' or 'stock', got {self.connector!r}")
        if self.kv_load_failure_policy not in (None, "recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy must be 'recompute', 'fail' or None, got {self.kv_load_failure_policy!r}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {TRANSFER_MODES}, got {self.transfer_mode!r}")
        for name, allowed in (("device", ("cpu", "cuda")), ("kv_buffer_device", (None, "cpu", "cuda"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def cpu_list(self) -> str | None:
        """The pinned core(s) as ``VLLM_CPU_OMP_THREADS_BIND`` and ``taskset --cpu-list`` write them (``"2,3"``), or None."""
        return None if self.cpu is None else ",".join(str(c) for c in ((self.cpu,) if isinstance(self.cpu, int) else self.cpu))

    def kv_transfer_config(self, run_dir: Path) -> dict:
        """The ``--kv-transfer-config`` JSON object for this server."""
        config: dict = {
            "kv_connector": {("leasekit", "pull"): CONNECTOR_NAME, ("leasekit", "push"): PUSH_CONNECTOR_NAME,
                             ("stock", "pull"): STOCK_CONNECTOR_NAME,
                             ("stock", "push"): STOCK_PUSH_CONNECTOR_NAME}[(self.connector, self.transfer_mode)],
            "kv_role": KV_ROLES[self.role],
            "kv_connector_extra_config": {"kv_lease_duration": self.lease_duration_s},
        }
        if self.kv_load_failure_policy is not None:
            config["kv_load_failure_policy"] = self.kv_load_failure_policy
        if self.kv_buffer_device is not None:
            config["kv_buffer_device"] = self.kv_buffer_device
        if self.connector == "leasekit":
            config["kv_connector_module_path"] = CONNECTOR_MODULE_PATH
            config["kv_connector_extra_config"]["leasekit_run_dir"] = str(run_dir)
            config["kv_connector_extra_config"].update(self.connector_extra)
        return config
