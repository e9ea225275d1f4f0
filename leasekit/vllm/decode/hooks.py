"""The D-side vLLM hooks of LeaseKitConnector's NIXL worker, forwarding to D's components.

:class:`DHooks` is a base of :class:`leasekit.vllm.connector.LeaseKitPullWorker` that overrides three
methods of vllm 0.32.0's NIXL worker (``.../kv_connector/v1/nixl/``) and nothing else. It holds NO
state and sets no attribute: each override keeps the stock call (``super()``), and hands the LeaseKit
part to the components the worker built in ``_lk_setup``:

- ``_lk_gate``: :class:`leasekit.vllm.decode.gate.DReadGate` (D's read gate and verdict inbox);
- ``_lk_dbeats``: :class:`leasekit.vllm.decode.heartbeats.DHeartbeatSender` (D's heartbeats and their
  fault points).

A worker whose LeaseKit part never ran (``_lk_ready`` False, the worker's class default: built without
``__init__``, as vLLM's own unit tests build workers) behaves exactly as vLLM's.
"""

from __future__ import annotations

from typing import Any


class DHooks:
    """D's overrides of vLLM's NIXL worker methods; stateless, forwarding only (see the module).

    Reads, on the worker it is a base of: ``_lk_ready`` (bool), ``_lk_gate``, ``_lk_dbeats``."""

    def _read_blocks(self, *args: Any, **kwargs: Any) -> bool:
        """Stock ``_read_blocks`` (``pull_worker.py``, every argument by keyword), after the read gate
        recorded which P agent must answer for a protected request and said hello to it
        (:meth:`leasekit.vllm.decode.gate.DReadGate.before_read`). When that request's lease has a secret
        (protocol version 4), the stock call gets ``remote_request_id=f"{rid}~{completion_tag(T, n)}"``
        (:meth:`leasekit.vllm.decode.gate.DReadGate.proved_read`), so that P's completion proves the lease.

        This relies on vllm 0.32.0 ``nixl/pull_worker.py`` ``_read_blocks`` using ``remote_request_id`` for
        nothing but the completion: line 442 ``notif_id = f"{remote_request_id}:{expected_consumers}".encode()``,
        which it sends on a full prefix-cache hit (line 450, ``send_notif``), attaches to the READ (line 552,
        ``make_prepped_xfer(..., notif_msg=notif_id)``) or, with mixed memory, queues for
        ``_send_pending_recv_notifs`` (line 543, ``_read_blocks_mixed(..., notif_id=notif_id)``). The MLA /
        DCP notice to the other P ranks in ``_read_blocks_for_req`` (line 374) builds its own completion from
        ``meta.remote.request_id``: it stays plain. Returns and raises as stock."""
        if not self._lk_ready:
            return super()._read_blocks(*args, **kwargs)  # type: ignore[misc]
        self._lk_gate.before_read(args, kwargs)
        return super()._read_blocks(*args, **self._lk_gate.proved_read(kwargs))  # type: ignore[misc]

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        """Stock polling (``base_worker.py``); on ``_recving_transfers``, finished protected reads are held
        back and held reads are reported done or failed once decided
        (:meth:`leasekit.vllm.decode.gate.DReadGate.poll`). Returns ``(done, failed)`` D request ids."""
        done, failed = super()._pop_done_transfers(transfers)  # type: ignore[misc]
        if not self._lk_ready:
            return done, failed
        return self._lk_gate.poll(transfers, done, failed)

    def _send_heartbeats(self, metadata: Any) -> None:
        """Stock heartbeat sending (``base_worker.py``), after the read gate's hello to P engines that
        speak the protocol (:meth:`leasekit.vllm.decode.gate.DReadGate.hello_engines`); with fault points
        enabled, batches may be dropped, delayed or duplicated
        (:meth:`leasekit.vllm.decode.heartbeats.DHeartbeatSender.send`). Raises as stock."""
        if not self._lk_ready:
            return super()._send_heartbeats(metadata)  # type: ignore[misc]
        self._lk_gate.hello_engines(metadata.heartbeat_by_engine)
        self._lk_dbeats.send(metadata, super()._send_heartbeats)  # type: ignore[misc]
