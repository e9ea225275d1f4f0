"""LeaseKitConnector: vLLM's (pull) NixlConnector plus lease spans, Prometheus metrics and logs.

Wire-compatible with stock peers: it sends and accepts exactly what NixlConnector does (heartbeats
``b"HB:" + b",".join(ids)``, completions ``b"{req_id}:{n}"``) and leaves the compatibility hash alone.
It observes through these hooks of vllm 0.32.0 and 0.33.0 (``.../kv_connector/v1/nixl/``; the
signatures and attributes it relies on are recorded per release in :mod:`leasekit.vllm.version`):

- grant: new keys of ``_reqs_to_send`` after ``start_load_kv`` (values: deadlines on the worker's
  ``perf_counter``, ``pull_worker.py``); blocks pinned come from the scheduler's ``request_finished``
  through the connector metadata;
- expire: ids ``_reap_expired_send_leases`` adds to ``done_sending`` (``base_worker.py``);
- abort: a lease that leaves ``_reqs_to_send`` any other way, or is open at worker shutdown;
- D side: tracking (``on_new_request`` / ``_stop_heartbeat`` of the scheduler, handed to the worker in
  the connector metadata) and heartbeat notifications sent (``send_notif`` of the NIXL wrapper).

and replaces some, delegating each to a component built with everything it uses passed in:

- P (:mod:`leasekit.vllm.prefill`): lease keeping is :class:`leasekit.lease.pkeeping.PLeaseKeeping`
  (pure rules: binding to the first D agent, max hold ``leasekit_max_hold_s``, grant pledges, an expiry
  heap that replaces vLLM's full-scan reap); ``_get_new_notifs`` is the notification intake (malformed,
  unknown, duplicate and foreign messages counted and dropped, never raised in P's engine loop); P's
  verdict channel answers D over ZMQ; the scheduler's side-channel listener survives bad requests.
- D (:mod:`leasekit.vllm.decode`): heartbeat sending (with the chaos fault points) and the read gate.

Fail closed (docs/fail-closed.md; on unless ``leasekit_fail_closed`` is false on P): P marks the
``kv_transfer_params`` it returns with ``leasekit_protocol``; a LeaseKit D then holds each finished read
until P confirmed that the lease covered it, and a read P had reaped, or not confirmed in time, is
reported failed so vLLM's ``kv_load_failure_policy`` applies.

Each transition goes to the lease span, to the Prometheus metrics (through vLLM's connector-stats
path, :mod:`leasekit.vllm.stats`, onto the server's own ``/metrics``) and to one structured log record
(:mod:`leasekit.telemetry.lease_log`). Lease spans join the request's trace when the HTTP request
carried a W3C ``traceparent`` (vLLM's ``Request.trace_headers``).

Configuration (``kv_connector_extra_config``): ``kv_lease_duration`` (vLLM's own),
``leasekit_run_dir`` (span directory; default env ``LEASEKIT_RUN_DIR``, else ``./leasekit-run``),
``leasekit_max_hold_s`` (seconds, ``[L, max(L, 86400)]``, default ``max(480, L)``), ``leasekit_max_notification_bytes``
(``[1024, 64 MiB]``, default 1 MiB), ``leasekit_verdict_timeout_s`` (D: seconds to wait for P's
verdict on a read, ``[0.05, 86400]``, default ``min(L, 600)``), ``leasekit_fail_closed`` (P: mark
requests for the fail-closed protocol; default true), ``leasekit_pledge_s`` (P: seconds after a grant
before which none of its blocks is freed, so that D can use a read finished by then with no wait;
``[0, L]``, default ``min(1, L)``, 0 off; leasekit/lease/pledge.py); an out-of-range value stops the
engine at start with the fix.
Telemetry errors are logged (rate-limited) and never raised into the engine loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import vllm

from leasekit.vllm.version import check_installed, check_vllm_release

check_vllm_release(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)
from leasekit.vllm.decode.hooks import DHooks  # noqa: E402
from leasekit.vllm.prefill.hooks import PHooks  # noqa: E402
from leasekit.vllm.scheduler import LeaseKitPullScheduler  # noqa: E402
from leasekit.vllm.connstats import LeaseKitConnectorStatsMixin  # noqa: E402
from leasekit.vllm.worker import LeaseKitWorkerMixin  # noqa: E402

check_installed(vllm.__version__)  # every hook's signature and every attribute LeaseKit reads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class LeaseKitPullWorker(LeaseKitWorkerMixin, PHooks, DHooks, NixlPullConnectorWorker):
    """Worker side of :class:`LeaseKitConnector`: vLLM's NIXL pull worker with LeaseKit's part
    (:class:`leasekit.vllm.worker.LeaseKitWorkerMixin`) and P's and D's hooks (:class:`PHooks`, :class:`DHooks`)."""



class LeaseKitConnector(LeaseKitConnectorStatsMixin, NixlPullConnector):
    """vLLM's pull-mode NixlConnector with lease spans on every P worker.

    Load with ``kv_connector="LeaseKitConnector"`` and
    ``kv_connector_module_path="leasekit.vllm.connector"``.

    Raises:
        leasekit.vllm.version.UnsupportedVllmError: at import, on an unsupported vLLM release or one
            whose hooks, signatures or attributes differ from the recorded ones.
        leasekit.lease.config.LeaseConfigError, leasekit.lease.settings.NotificationConfigError,
        leasekit.lease.settings.ReadGateConfigError: at start (worker role), a ``kv_lease_duration`` or
            ``leasekit_*`` value out of range; the message names the field, the range and the fix
            (``leasekit lint`` reports the same before a start).
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


from leasekit.vllm.push import PUSH_CONNECTOR_NAME, LeaseKitPushConnector  # noqa: E402  (same module path, push mode)

__all__ = ["LeaseKitConnector", "LeaseKitPullWorker", "LeaseKitPushConnector", "PUSH_CONNECTOR_NAME"]
