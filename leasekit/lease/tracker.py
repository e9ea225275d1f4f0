"""D's heartbeat bookkeeping: which leases D keeps alive, and when it sends a batch.

Reference model of vllm 0.32.0 ``base_scheduler.py``: ``on_new_request`` starts tracking a request
as soon as it enters D's scheduler (not when it is scheduled), grouped by ``remote_engine_id``;
``_stop_heartbeat`` stops it when the read is done (``update_connector_output``), or the request
finishes or is aborted (``request_finished``); ``build_connector_meta`` hands every engine's batch to
the workers once per interval ``H`` under one global timer (``now - last >= H``, not advanced
while nothing is tracked). vLLM starts ``last`` at 0.0 on a ``perf_counter`` that counts seconds
since boot, so the first batch goes out at once; the model starts it at ``-inf`` (pass
``last_batch_s=0.0`` to replay vLLM on a clock that starts near zero). Each D worker then sends the batch to every P
rank it handshook with (see :mod:`leasekit.lease.topology`).
"""

from __future__ import annotations

from dataclasses import dataclass

from leasekit.lease.config import LeaseTiming


@dataclass(frozen=True, slots=True)
class Tracked:
    """A request D keeps alive: P's engine and P's request id for D's local request id."""

    local_req_id: str
    engine_id: str
    remote_req_id: str


class DHeartbeatTracker:
    """Tracks D's waiting/running requests per remote P engine and emits heartbeat batches.

    Args:
        timing: ``H`` comes from it (``L // 6``).
        last_batch_s: when the previous batch went out (seconds, D's clock); ``-inf``: never.

    All methods are O(1) per request except :meth:`due`, which is O(tracked) when a batch is due.
    """

    def __init__(self, timing: LeaseTiming, *, last_batch_s: float = float("-inf")):
        self.timing = timing
        self._by_engine: dict[str, set[str]] = {}
        self._by_local: dict[str, Tracked] = {}
        self._last_batch_s = last_batch_s

    def __len__(self) -> int:
        return len(self._by_local)

    def __contains__(self, local_req_id: object) -> bool:
        return local_req_id in self._by_local

    def on_enqueue(self, local_req_id: str, engine_id: str | None, remote_req_id: str | None) -> bool:
        """Start tracking when the request enters D's scheduler; False without the remote fields
        (vLLM tracks only requests with ``do_remote_prefill`` and every remote field set)."""
        if not engine_id or not remote_req_id:
            return False
        self._by_local[local_req_id] = Tracked(local_req_id, engine_id, remote_req_id)
        self._by_engine.setdefault(engine_id, set()).add(remote_req_id)
        return True

    def stop(self, local_req_id: str) -> bool:
        """Stop tracking (read done, finished or aborted); idempotent. Empty engines are dropped."""
        tracked = self._by_local.pop(local_req_id, None)
        if tracked is None:
            return False
        ids = self._by_engine.get(tracked.engine_id)
        if ids is not None:
            ids.discard(tracked.remote_req_id)
            if not ids:
                del self._by_engine[tracked.engine_id]
        return True

    def due(self, now_s: float) -> dict[str, tuple[str, ...]]:
        """The batches to send this step: ``{engine_id: sorted P request ids}``, or ``{}``.

        One batch per engine, at most once per ``H`` seconds (a global timer, as in vLLM).
        """
        if not self._by_engine or now_s - self._last_batch_s < self.timing.heartbeat_interval_s:
            return {}
        self._last_batch_s = now_s
        return {engine: tuple(sorted(ids)) for engine, ids in self._by_engine.items()}

    def engines(self) -> list[str]:
        """Remote engines with tracked requests."""
        return list(self._by_engine)
