"""What a P/D pair is started with: :class:`PairSpec` (connectors, lease, cores, launch conditions,
the deployment) and :func:`default_cpus`. Kept apart from :mod:`leasekit.cluster.pair`, which starts,
uses and stops the servers a spec describes.
"""

from __future__ import annotations

import dataclasses
import os

from leasekit.cluster.pairfile import PairFile


def default_cpus() -> tuple[int | None, int | None]:
    """Cores for (P, D): the first two cores this process may use, or unpinned if fewer than two."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return cores[0], cores[1]


@dataclasses.dataclass
class PairSpec:
    """A P/D pair to start: connectors, lease duration (s), D's running-slot limit, cores, and
    launch-time conditions (seconds): a monotonic-clock offset per side (a Linux time namespace),
    a wall-clock offset and rate per side (libfaketime, monotonic left real), two hosts (``network_namespace``:
    P and D each in its own network namespace of a :class:`leasekit.cluster.testbed.Testbed`, so NIXL/UCX
    between them crosses a bridge and nftables partitions can cut it), connector fault-control files, and millisecond lease
    logging (the evidence for stock connectors, which write no spans), and vLLM's own request tracing
    (``--otlp-traces-endpoint``, OTLP over HTTP/protobuf; vLLM keeps an incoming ``traceparent`` only
    when tracing is on, ``vllm/v1/engine/async_llm.py``), and LeaseKit P's max hold in seconds
    (``leasekit_max_hold_s``; None keeps the connector's default), and D's ``kv_load_failure_policy``
    (``recompute`` by default here: a read LeaseKit D discards is recomputed; ``fail`` ends the request
    with an error; vLLM's own default is ``fail``), and P's KV cache in bytes (None: the server default,
    64 MiB; a small one makes freed blocks reused soon), and whether LeaseKit P turns on the fail-closed
    protocol (``leasekit_fail_closed``, the connector's default; False sets it false, docs/fail-closed.md),
    and LeaseKit P's grant pledge in seconds (``leasekit_pledge_s``; None keeps the connector's default),
    and the deployment (a pair file, :mod:`leasekit.cluster.pairfile`: hosts, devices, model, TP, ports;
    None is the CPU default, which an empty pair file describes too), and the NIXL transfer mode
    (``pull``, or ``push``: LeaseKitPushConnector for a ``leasekit`` connector, vLLM's NixlPushConnector for
    ``stock``)."""

    prefill_connector: str = "leasekit"
    decode_connector: str = "leasekit"
    lease_duration_s: float = 30
    decode_max_num_seqs: int = 1
    prefill_cpu: int | None = None
    decode_cpu: int | None = None
    prefill_monotonic_offset_s: float = 0.0
    decode_monotonic_offset_s: float = 0.0
    prefill_wall_offset_s: float = 0.0
    prefill_wall_rate: float = 1.0
    decode_wall_offset_s: float = 0.0
    decode_wall_rate: float = 1.0
    network_namespace: bool = False
    fault_files: bool = False
    lease_logging: bool = False
    warm_up: bool = True
    otlp_traces_endpoint: str | None = None
    prefill_max_hold_s: float | None = None
    decode_kv_load_failure_policy: str | None = "recompute"
    prefill_kv_cache_bytes: int | None = None
    fail_closed: bool = True
    prefill_pledge_s: float | None = None
    deployment: PairFile | None = None
    transfer_mode: str = "pull"

    def __post_init__(self) -> None:
        if self.transfer_mode not in ("pull", "push"):
            raise ValueError(f"transfer_mode must be 'pull' or 'push', got {self.transfer_mode!r}")

    def launch_key(self) -> tuple:
        """Everything that needs a fresh pair when it changes (hashable: the deployment as its JSON)."""
        return tuple(self.deployment.model_dump_json() if f.name == "deployment" and self.deployment is not None
                     else getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def pinned(cls, **kwargs) -> "PairSpec":
        """A spec pinned to :func:`default_cpus` unless cores are given."""
        p_cpu, d_cpu = default_cpus()
        kwargs.setdefault("prefill_cpu", p_cpu)
        kwargs.setdefault("decode_cpu", d_cpu)
        return cls(**kwargs)
