"""Drive a built worker the way vLLM 0.32.0's engine does, one engine step at a time.

:func:`engine_step` is the worker-side call sequence of one engine step, exactly as
``vllm/v1/worker/kv_connector_model_runner_mixin.py`` (``_get_kv_connector_output``, used by
``execute_model`` and by ``kv_connector_no_forward``) makes it on the worker-role connector
(``get_kv_transfer_group()``; the connector forwards to its worker, ``nixl/connector.py``).
The step's metadata comes from the scheduler-role connector's ``build_connector_meta``, as the
scheduler builds it once per step (``vllm/v1/core/sched/scheduler.py``), and the step's
``KVConnectorOutput`` goes back to the scheduler's ``update_connector_output``: neither is timed
(they run in the scheduler process).

:class:`PSide` (prefill) and :class:`DSide` (decode) pair one scheduler-role and one worker-role
connector of the same kind (stock ``NixlPullConnector`` or ``LeaseKitConnector``).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Iterable

from benchmarks.pstep import build as B
from leasekit.lease.proof import completion_tag, heartbeat_tag, lease_secret


def engine_step(connector: Any, metadata: Any, finished_req_ids: frozenset = frozenset()) -> Any:
    """One engine step's calls on the worker-role ``connector`` (``kv_connector_model_runner_mixin.py``
    ``_get_kv_connector_output``, async loads started after the forward pass): ``bind_connector_metadata``,
    ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
    ``get_kv_connector_stats``, ``get_kv_connector_kv_cache_events``, ``build_connector_worker_meta``,
    ``clear_connector_metadata``. Returns ``get_transfer_results``' result (``finished_sending``,
    ``finished_recving``, ``failed_recving``: sets of request ids)."""
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)  # the forward context: NixlPullConnector.start_load_kv does not read it
    connector.wait_for_save()
    results = connector.get_transfer_results(finished_req_ids)
    connector.get_block_ids_with_load_errors()
    connector.get_kv_connector_stats()
    connector.get_kv_connector_kv_cache_events()
    connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    return results


def request_id(i: int) -> str:
    """The ``i``-th request id, shaped like vLLM's OpenAI server's (``cmpl-<32 hex>-0``, 39 characters)."""
    return f"cmpl-{i:032x}-0"


def heartbeat(ids: Iterable[str]) -> bytes:
    """D's heartbeat notification naming ``ids`` (``base_worker.py`` ``_send_heartbeats``: ``"HB:" + ",".join``)."""
    return b"HB:" + ",".join(ids).encode()


def completion(req_id: str, consumers: int = 1) -> bytes:
    """D's read-completion notification (``pull_worker.py`` ``_read_blocks``: ``f"{id}:{consumers}"``)."""
    return f"{req_id}:{consumers}".encode()


class Side:
    """One scheduler-role and one worker-role connector of one kind; ``label`` names it in results."""

    def __init__(self, v: SimpleNamespace, label: str, *, leasekit: bool, kv_role: str, engine_id: str,
                 agent_name: str, model_dir: str, run_dir: str | None, export: bool = True,
                 extra_env: dict[str, str | None] | None = None) -> None:
        self.v, self.label, self.leasekit, self.export = v, label, leasekit, export
        self.config = B.make_vllm_config(v, model_dir, leasekit=leasekit, kv_role=kv_role, engine_id=engine_id,
                                         run_dir=run_dir)
        kv_cache_config = B.make_kv_cache_config(v)
        cls = B.connector_classes(v, leasekit)
        self.scheduler = B.scheduler_connector(v, cls, self.config, kv_cache_config)
        if leasekit:
            self.worker, self.wrapper = B.make_leasekit_worker(v, self.config, engine_id, agent_name, export=export,
                                                                 extra_env=extra_env)
        else:
            self.worker, self.wrapper = B.make_stock_worker(v, self.config, engine_id, agent_name)
        self.connector = B.worker_connector(v, cls, self.config, kv_cache_config, self.worker)
        self._empty_output = v.SchedulerOutput.make_empty  # a step that schedules nothing new

    def metadata(self) -> Any:
        """This step's connector metadata from the scheduler (nothing new unless requests changed)."""
        return self.scheduler.build_connector_meta(self._empty_output())

    def finish_step(self, results: Any) -> None:
        """Hand the step's output to the scheduler (``update_connector_output``), untimed."""
        self.scheduler.update_connector_output(self.v.KVConnectorOutput(
            finished_sending=set(results.finished_sending or ()), finished_recving=set(results.finished_recving or ()),
            failed_recving=set(results.failed_recving or ())))

    def step(self) -> Any:
        """One whole engine step (scheduler metadata, worker calls, output back); returns the results."""
        results = engine_step(self.connector, self.metadata())
        self.finish_step(results)
        return results

    @property
    def live(self) -> dict[str, float]:
        """The worker's live leases: vLLM's ``_reqs_to_send`` (request id -> deadline, worker perf_counter s)."""
        return self.worker._reqs_to_send


class PSide(Side):
    """A prefill engine: grants leases through its scheduler and ``start_load_kv``; receives D's
    notifications from agent :data:`benchmarks.pstep.build.D_AGENT`."""

    def __init__(self, v: SimpleNamespace, label: str, **kw: Any) -> None:
        super().__init__(v, label, kv_role="kv_producer", engine_id=B.P_ENGINE, agent_name=B.P_AGENT, **kw)
        self._no_blocks = v.KVCacheBlocks(blocks=((),))

    def register_and_finish(self, ids: Iterable[str]) -> None:
        """The scheduler's calls for prefills that were scheduled and finished (``on_new_request``,
        ``update_state_after_alloc``, ``request_finished_all_groups`` with two KV blocks): each becomes
        a lease in the next step's ``reqs_to_send``."""
        v, s = self.v, self.scheduler
        for req_id in ids:
            req = B.make_request(v, req_id, {"do_remote_decode": True, "do_remote_prefill": False})
            s.on_new_request(req)
            s.update_state_after_alloc(req, self._no_blocks, 0)
            req.status = v.RequestStatus.FINISHED_LENGTH_CAPPED
            req.num_computed_tokens = req.num_prompt_tokens
            delay_free, params = s.request_finished_all_groups(req, ([1, 2],))
            if not delay_free or not params:
                raise RuntimeError(f"P scheduler did not hold the blocks of {req_id}: {delay_free}, {params}")

    def grant(self, ids: Iterable[str], batch: int = 1000, age_s: float = 0.0) -> int:
        """Grant a lease to each of ``ids``: ``batch`` requests finish per engine step. Returns the
        number of request ids reported in ``finished_sending`` meanwhile (0 unless something expired).

        ``age_s``: seconds the leases are aged at their grant: the metadata's ``scheduler_clock`` reads
        ``age_s`` later than the scheduler's, so the worker's rebase (``pull_worker.py`` ``start_load_kv``:
        ``now + (deadline - scheduler_clock)``) gives ``L - age_s`` seconds left, as for a lease granted
        ``age_s`` ago. With ``age_s = L - E`` every later heartbeat moves the deadline (``max(old, now + E)``)."""
        ids = list(ids)
        ended = 0
        for start in range(0, len(ids), batch):
            self.register_and_finish(ids[start:start + batch])
            metadata = self.metadata()
            if age_s and metadata.scheduler_clock:
                metadata.scheduler_clock += age_s
            results = engine_step(self.connector, metadata)
            self.finish_step(results)
            ended += len(results.finished_sending or ())
        return ended

    @property
    def age_s(self) -> float:
        """``L - E`` (seconds): the age at which a lease's deadline is ``now + E``, where each heartbeat
        moves it (``E``: vLLM's ``_lease_extension``, ``base_worker.py:532``)."""
        lease_duration = self.config.kv_transfer_config.get_from_extra_config("kv_lease_duration", 30)
        return float(lease_duration - self.worker._lease_extension)

    def _lease_key(self) -> bytes | None:
        """The engine key LeaseKit P's scheduler mints lease secrets with (None: stock, or no secrets)."""
        return getattr(getattr(self.scheduler, "connector_scheduler", None), "_lk_lease_key", None)

    def heartbeat(self, ids: Iterable[str]) -> bytes:
        """The heartbeat the matching D sends naming ``ids``: a LeaseKit D names each lease with its tag
        (``<id>~<tag>``, :mod:`leasekit.lease.proof`, from the secret in the grant), a stock D plainly."""
        key = self._lease_key()
        if key is None:
            return heartbeat(ids)
        return heartbeat(f"{i}~{heartbeat_tag(lease_secret(key, i))}" for i in ids)

    def completion(self, req_id: str, consumers: int = 1) -> bytes:
        """The read completion the matching D sends (LeaseKit D: ``<id>~<completion tag>:<n>``)."""
        key = self._lease_key()
        if key is None:
            return completion(req_id, consumers)
        return completion(f"{req_id}~{completion_tag(lease_secret(key, req_id), consumers)}", consumers)

    def deliver(self, messages: list[bytes]) -> None:
        """Queue D's notifications for the worker's next ``get_new_notifs``."""
        self.wrapper.deliver(B.D_AGENT, messages)


class DSide(Side):
    """A decode engine with N requests waiting for their KV: its scheduler tracks them for heartbeats
    (``on_new_request``) with the ``kv_transfer_params`` a P of the same kind returned for them, and
    its worker has handshaken with that P (one TP rank, agent :data:`benchmarks.pstep.build.P_AGENT`)."""

    def __init__(self, v: SimpleNamespace, label: str, *, model_dir: str, run_dir: str | None, **kw: Any) -> None:
        super().__init__(v, label, kv_role="kv_consumer", engine_id=B.D_ENGINE, agent_name=B.D_AGENT,
                         model_dir=model_dir, run_dir=run_dir, **kw)
        # The P whose kv_transfer_params D receives (its scheduler only: it mints the params).
        p_config = B.make_vllm_config(v, model_dir, leasekit=self.leasekit, kv_role="kv_producer",
                                      engine_id=B.P_ENGINE, run_dir=run_dir)
        self.p_scheduler = B.scheduler_connector(v, B.connector_classes(v, self.leasekit), p_config,
                                                 B.make_kv_cache_config(v))
        self._no_blocks = v.KVCacheBlocks(blocks=((),))
        self._n = 0

    def handshake(self) -> None:
        """What a finished handshake with P leaves on D's worker (``_ensure_handshake``'s done callback,
        ``base_worker.py:1305-1316``): P's agent per rank, its last activity and its address."""
        w = self.worker
        host, port = self.p_scheduler.connector_scheduler.side_channel_host, \
            self.p_scheduler.connector_scheduler.side_channel_port
        w._remote_agents[B.P_ENGINE] = {(0, 0): B.P_AGENT}
        w._engine_clock_offset[B.P_ENGINE] = 0.0
        w._engine_last_active[B.P_ENGINE] = time.perf_counter()
        w._engine_by_address[(host, port)] = B.P_ENGINE

    def p_params(self, p_id: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` P's scheduler returns for a finished prefill ``p_id``."""
        v, s = self.v, self.p_scheduler
        req = B.make_request(v, p_id, {"do_remote_decode": True, "do_remote_prefill": False})
        s.on_new_request(req)
        s.update_state_after_alloc(req, self._no_blocks, 0)
        req.status = v.RequestStatus.FINISHED_LENGTH_CAPPED
        req.num_computed_tokens = req.num_prompt_tokens
        _, params = s.request_finished_all_groups(req, ([1, 2],))
        return params

    def track(self, count: int, batch: int = 1000) -> None:
        """Enqueue ``count`` requests on D (``on_new_request``), ``batch`` per engine step; they wait."""
        v = self.v
        for start in range(0, count, batch):
            for _ in range(min(batch, count - start)):
                self._n += 1
                params = self.p_params(request_id(self._n))
                self.scheduler.on_new_request(B.make_request(v, f"d-{request_id(self._n)}", params))
            self.p_scheduler.build_connector_meta(v.SchedulerOutput.make_empty())  # P's side clears its state
            self.step()

    def heartbeat_metadata(self) -> Any:
        """The metadata of a step at which D's heartbeat interval has elapsed: the scheduler's throttle
        (``base_scheduler.py`` ``build_connector_meta``: ``_last_heartbeat_time``) is rewound, so it
        packages ``heartbeat_by_engine`` (every tracked request) as it does every ``L // 6`` s."""
        self.scheduler.connector_scheduler._last_heartbeat_time = float("-inf")
        return self.metadata()
