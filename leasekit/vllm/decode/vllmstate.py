"""The one door from D's components to vLLM's NIXL worker state.

D's components (:class:`leasekit.vllm.decode.gate.DReadGate`,
:class:`leasekit.vllm.decode.heartbeats.DHeartbeatSender`) read and write a handful of vLLM's private
worker attributes. Each of them is reached only through :class:`VllmDState`, which reads the worker's
attribute at the moment of use (vLLM, and vLLM's own unit tests, may rebind them), so that the list below
is the complete D-side contract with vLLM. The attributes and the method are those recorded for vllm
0.32.0 and 0.33.0 in :mod:`leasekit.vllm.version` (``.../kv_connector/v1/nixl/base_worker.py`` and
``pull_worker.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

from leasekit.vllm.kvdigest import kv_digest


class VllmDState:
    """D's view of vLLM's NIXL worker (``NixlPullConnectorWorker``): the only vLLM state D's components
    touch, read from the worker on every access (never cached).

    Args:
        worker: vLLM's NIXL worker, or in tests any object with the attributes below.

    Reads (``base_worker.py`` unless noted): ``tp_rank``; ``_remote_agents`` (P engine id -> {(dp rank,
    TP rank): NIXL agent name}); ``_recving_transfers`` (D request id -> NIXL transfer handles; the
    receive map vLLM polls with ``_pop_done_transfers``); ``_recving_metadata`` (D request id -> ``ReqMeta``,
    set in ``pull_worker.py`` ``start_load_kv``); ``_recv_failures`` (D request ids whose receive vLLM
    already failed); ``nixl_wrapper`` (the NIXL wrapper, which LeaseKit wraps in a
    :class:`leasekit.vllm.taps.NotificationTap`); the KV cache layout :func:`leasekit.vllm.kvdigest.kv_digest`
    reads. Calls: ``_send_pending_recv_notifs(req_id)``. Writes: none. A missing attribute raises
    AttributeError at the access.
    """

    __slots__ = ("_worker",)

    def __init__(self, worker: Any):
        self._worker = worker

    @property
    def tp_rank(self) -> int:
        """This worker's TP rank (``tp_rank``)."""
        return self._worker.tp_rank

    @property
    def remote_agents(self) -> dict[str, dict[Any, str]]:
        """``_remote_agents``: P engine id -> {(dp rank, TP rank): NIXL agent name}, filled by the handshake."""
        return self._worker._remote_agents

    @property
    def recving_transfers(self) -> dict[str, Any]:
        """``_recving_transfers``: D request id -> NIXL transfer handles of its KV read (identity matters:
        ``_pop_done_transfers`` is called with this map for reads, with others for sends)."""
        return self._worker._recving_transfers

    @property
    def recving_metadata(self) -> dict[str, Any]:
        """``_recving_metadata``: D request id -> vLLM's ``ReqMeta`` (``local_block_ids``, ``remote.request_id``)."""
        return self._worker._recving_metadata

    @property
    def recv_failures(self) -> set[str]:
        """``_recv_failures``: D request ids whose receive vLLM already marked failed."""
        return self._worker._recv_failures

    @property
    def nixl_wrapper(self) -> Any:
        """``nixl_wrapper``: NIXL's wrapper as the worker holds it now (``send_notif(agent, notif_msg=...)``);
        after LeaseKit's setup a :class:`leasekit.vllm.taps.NotificationTap`, whose ``_wrapped`` is the raw one."""
        return self._worker.nixl_wrapper

    def send_pending_recv_notifs(self, request_id: str) -> None:
        """vLLM's ``_send_pending_recv_notifs(req_id)``: send the completions a mixed-memory read deferred,
        so that P hears of the read now. Raises whatever vLLM's method raises."""
        self._worker._send_pending_recv_notifs(request_id)

    def kv_digest(self, block_ids: Sequence[int]) -> str | None:
        """:func:`leasekit.vllm.kvdigest.kv_digest` of this worker's local KV blocks ``block_ids`` (16 hex
        characters; None off the CPU platform or with an unknown layout). Chaos evidence only."""
        return kv_digest(self._worker, block_ids)
