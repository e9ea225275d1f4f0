"""Replay lease event scripts through vLLM 0.32.0's own NixlConnector lease code and leasekit's model.

Used by ``tests/unit/test_differential_vllm_*.py``. Pure logic on CPU: no server, no NIXL agent, no
network. vLLM is imported lazily (:func:`load_vllm`), so importing this module never needs vLLM.

How the vLLM side is built (module ``vllm.distributed.kv_transfer.kv_connector.v1.nixl``):

- Schedulers are real ``NixlPullConnectorScheduler`` objects built by their own ``__init__`` from a
  real ``VllmConfig`` (local tiny Llama config dir, ``DeviceConfig("cpu")``) and a one-group
  ``KVCacheConfig``, as vLLM's ``tests/v1/kv_connector/unit/utils.py`` does. Requests are real
  ``vllm.v1.request.Request`` objects. Their heartbeat/lease methods run unmodified.
- Workers are ``object.__new__(NixlPullConnectorWorker)``: the real ``__init__`` creates a NIXL agent
  and reads the attention backend and the TP group. :func:`make_worker` sets exactly the attributes
  the lease paths read, the way ``__init__`` sets them (``base_worker.py`` line cited per attribute),
  with a :class:`FakeNixlWrapper` (``get_new_notifs``/``send_notif`` only) in place of the NIXL agent.
- Time: every module of the lease paths does ``import time`` and calls ``time.perf_counter()``, so
  :func:`patched_clocks` replaces the module-global ``time`` of ``base_worker``/``pull_worker``
  (worker clock) and ``base_scheduler``/``pull_scheduler`` (scheduler clock) with a proxy whose
  ``perf_counter`` is a manual clock. The real ``time`` module (used by pytest, hypothesis, logging)
  is untouched.

Times in scripts are multiples of 1/4 s (and ``L`` is 6, 12, 30 or 7.5): every sum vLLM forms
(``scheduler_now + L``, the rebase ``now_local + (deadline - scheduler_clock)``, ``now + E``) is then
exact in binary floating point, so deadlines can be compared with ``==`` and boundary instants
(``now == deadline``) are hit exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator

from leasekit.lease.codec import decode_notification
from leasekit.lease.config import LeaseTiming
from leasekit.lease.table import LeaseEnd, Outcome, PLeaseTable
from leasekit.lease.tracker import DHeartbeatTracker

NIXL_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

P_ENGINE = "P-engine"
D_ENGINE = "D-engine"


# --------------------------------------------------------------------------------------------
# vLLM objects
# --------------------------------------------------------------------------------------------
def load_vllm() -> SimpleNamespace:
    """Import the vLLM modules the replay drives (raises ImportError when vLLM is missing)."""
    mods = {name: importlib.import_module(f"{NIXL_PKG}.{name}") for name in (
        "base_scheduler", "pull_scheduler", "base_worker", "pull_worker", "metadata", "stats", "tp_mapping")}
    import vllm
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus

    return SimpleNamespace(
        version=vllm.__version__, **mods,
        CacheConfig=CacheConfig, DeviceConfig=DeviceConfig, KVTransferConfig=KVTransferConfig,
        ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig,
        SamplingParams=SamplingParams, KVCacheBlocks=KVCacheBlocks, KVCacheBlock=KVCacheBlock,
        SchedulerOutput=SchedulerOutput, KVConnectorOutput=KVConnectorOutput,
        Request=Request, RequestStatus=RequestStatus,
    )


BLOCK_SIZE = 16


def make_vllm_config(v: SimpleNamespace, model_dir: str, lease_duration: float, kv_role: str):
    """A real VllmConfig for the tiny local Llama (no download, no tokenizer) with NixlConnector."""
    model_config = v.ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True)
    return v.VllmConfig(
        model_config=model_config,
        scheduler_config=v.SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, max_model_len=1024,
            is_encoder_decoder=model_config.is_encoder_decoder),
        cache_config=v.CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=v.KVTransferConfig(
            kv_connector="NixlConnector", kv_role=kv_role,
            kv_connector_extra_config={"kv_lease_duration": lease_duration}),
        device_config=v.DeviceConfig("cpu"),
    )


def make_kv_cache_config(v: SimpleNamespace):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=1000, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])


def make_scheduler(v: SimpleNamespace, vllm_config, engine_id: str):
    """A real ``NixlPullConnectorScheduler`` (its ``__init__`` starts no thread and opens no socket)."""
    return v.pull_scheduler.NixlPullConnectorScheduler(vllm_config, engine_id, make_kv_cache_config(v))


def make_request(v: SimpleNamespace, req_id: str, kv_transfer_params: dict[str, Any] | None):
    req = v.Request(request_id=req_id, prompt_token_ids=list(range(1, 2 * BLOCK_SIZE + 1)),
                    sampling_params=v.SamplingParams(max_tokens=1), pooling_params=None)
    req.kv_transfer_params = kv_transfer_params
    return req


class FakeNixlWrapper:
    """Stands in for ``NixlWrapper`` (``base_worker.py:644``): scripted inbox, recorded sends."""

    def __init__(self) -> None:
        self.inbox: dict[str, list[bytes]] = {}
        self.sent: list[tuple[str, bytes]] = []

    def deliver(self, batch: dict[str, list[bytes]]) -> None:
        for agent, msgs in batch.items():
            self.inbox.setdefault(agent, []).extend(msgs)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.inbox = self.inbox, {}
        return out

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        self.sent.append((agent_name, notif_msg))


class FakeTopology:
    """Stands in for ``TransferTopology`` (set by ``register_kv_caches``, ``base_worker.py:1368``):
    ``_get_new_notifs`` only asserts it is set; ``_read_blocks`` asks the remote block size/ratio."""

    def get_engine_info(self, engine_id: str) -> SimpleNamespace:
        return SimpleNamespace(remote_block_size=BLOCK_SIZE)

    def block_size_ratio(self, remote_block_size: int) -> int:
        return 1


def make_worker(v: SimpleNamespace, lease_duration: float):
    """``NixlPullConnectorWorker`` without ``__init__``; the attributes its lease paths read, set as
    ``NixlBaseConnectorWorker.__init__`` (vllm 0.32.0 ``nixl/base_worker.py``) sets them."""
    w = object.__new__(v.pull_worker.NixlPullConnectorWorker)
    w._lease_extension = lease_duration * 2 // 3  # :528-532
    w.nixl_wrapper = FakeNixlWrapper()  # :644 (NixlWrapper(uuid, config))
    w._remote_agents = defaultdict(dict)  # :647-649
    w.tp_rank = 0  # :661
    w.pcp_rank = 0  # :665 (pcp_size 1)
    w.pcp_dcp_sharded = False  # :668
    w._hb_handshake_notif_only = False  # :781
    w._recving_metadata = {}  # :806
    w._recving_transfers = defaultdict(list)  # :807
    w._reqs_to_send = {}  # :809
    w._replicated_pcp_done_sending = set()  # :812
    w._reqs_to_process = set()  # :814
    w._ready_requests = queue.Queue()  # :833
    w._handshake_futures = {}  # :834-836
    w._handshake_lock = threading.RLock()  # :838
    w._engine_last_active = {}  # :841
    w._engine_ttl = 3600.0  # :842-844 (default)
    w._engine_by_address = {}  # :846
    w.transfer_topo = FakeTopology()  # :869 None, set at :1368 by register_kv_caches
    w.consumer_notification_counts_by_req = defaultdict(int)  # :873
    w.expected_consumer_notifications_by_req = {}  # :874
    w.xfer_stats = v.stats.NixlKVConnectorStats()  # :875
    return w


# --------------------------------------------------------------------------------------------
# Clocks
# --------------------------------------------------------------------------------------------
class ManualClock:
    """A monotonic clock set by the test (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _TimeProxy:
    """The ``time`` module with ``perf_counter`` replaced; everything else delegates."""

    def __init__(self, real, perf_counter) -> None:
        self._real = real
        self.perf_counter = perf_counter

    def __getattr__(self, name: str):
        return getattr(self._real, name)


@contextlib.contextmanager
def patched_clocks(v: SimpleNamespace, worker, scheduler) -> Iterator[None]:
    """Point ``time.perf_counter`` of the worker modules at ``worker`` and of the scheduler modules
    at ``scheduler`` (callables returning seconds); restored on exit."""
    targets = [(v.base_worker, worker), (v.pull_worker, worker),
               (v.base_scheduler, scheduler), (v.pull_scheduler, scheduler)]
    saved = []
    try:
        for module, clock in targets:
            real = module.time
            assert getattr(real, "__name__", None) == "time", f"{module.__name__} no longer imports time"
            saved.append((module, real))
            module.time = _TimeProxy(real, clock)
        yield
    finally:
        for module, real in reversed(saved):
            module.time = real


# --------------------------------------------------------------------------------------------
# P side: scripts, vLLM replay, model replay
# --------------------------------------------------------------------------------------------
@dataclass
class PStep:
    """One engine step of P at ``t`` (seconds on the worker clock).

    ``register``: P scheduled the prefill (``update_state_after_alloc`` -> ``reqs_in_batch``).
    ``finish``: the prefill finished (``request_finished`` -> ``reqs_to_send``, deadline ``t + L``):
    the grant, applied by the worker's ``start_load_kv`` in this step. ``grant`` is both at once.
    ``notifs``: the NIXL notifications drained this step, ``{agent: [bytes]}`` in delivery order.
    """

    t: float
    grant: tuple[str, ...] = ()
    register: tuple[str, ...] = ()
    finish: tuple[str, ...] = ()
    notifs: dict[str, list[bytes]] = field(default_factory=dict)


@dataclass
class PObs:
    """What one P step did: live leases with deadlines, releases by completion, expiries."""

    live: dict[str, float]
    released: frozenset[str]
    expired: frozenset[str]
    # Per live lease: completions counted so far (vLLM: messages; model: senders or messages).
    counted: dict[str, int] = field(default_factory=dict)


class VllmP:
    """P driven through vLLM: a real P scheduler (``kv_producer``) feeding an ``object.__new__`` worker.

    One step: scheduler events, ``build_connector_meta``, worker ``start_load_kv`` (grants, deadlines
    rebased from the scheduler clock), then ``get_transfer_results``' lease part:
    ``done = _get_new_notifs()`` and ``_reap_expired_send_leases(done)`` (``base_worker.py:2860, 2985``).
    """

    def __init__(self, v: SimpleNamespace, producer_config, lease_duration: float,
                 worker_clock: ManualClock, scheduler_epoch_offset: float = 0.0) -> None:
        self.v = v
        self.scheduler = make_scheduler(v, producer_config, P_ENGINE)
        self.worker = make_worker(v, lease_duration)
        self.clock = worker_clock
        self.scheduler_clock = lambda: worker_clock.now + scheduler_epoch_offset
        self.requests: dict[str, Any] = {}
        self._empty_blocks = v.KVCacheBlocks(blocks=((),))

    def clocks(self):
        return patched_clocks(self.v, self.clock, self.scheduler_clock)

    def register(self, req_id: str) -> None:
        req = make_request(self.v, req_id, {"do_remote_decode": True, "do_remote_prefill": False})
        self.requests[req_id] = req
        self.scheduler.on_new_request(req)
        self.scheduler.update_state_after_alloc(req, self._empty_blocks, 0)

    def finish(self, req_id: str) -> dict[str, Any]:
        req = self.requests[req_id]
        req.status = self.v.RequestStatus.FINISHED_LENGTH_CAPPED
        req.num_computed_tokens = req.num_prompt_tokens
        delay_free, params = self.scheduler.request_finished(req, ([1, 2],))
        assert delay_free and params["remote_request_id"] == req_id
        return params

    def step(self, step: PStep) -> PObs:
        self.clock.now = step.t
        with self.clocks():
            for req_id in step.register + step.grant:
                self.register(req_id)
            for req_id in step.finish + step.grant:
                self.finish(req_id)
            meta = self.scheduler.build_connector_meta(self.v.SchedulerOutput.make_empty())
            self.worker.start_load_kv(meta)
            self.worker.nixl_wrapper.deliver(step.notifs)
            released = self.worker._get_new_notifs()
            expired: set[str] = set()
            self.worker._reap_expired_send_leases(expired)
        w = self.worker
        return PObs(dict(w._reqs_to_send), frozenset(released), frozenset(expired),
                    {r: c for r, c in w.consumer_notification_counts_by_req.items() if r in w._reqs_to_send})

    def counters(self) -> dict[str, int]:
        data = self.worker.xfer_stats.data
        return {"expired": len(data["num_kv_expired_reqs"]),
                "notifications_after_expiry": len(data["num_notifications_after_expiry"])}


class ModelP:
    """P driven through leasekit: ``PLeaseTable.grant`` for each grant, then ``step`` (drain, reap).

    ``anonymous=True`` passes every completion without its sender: the table then counts messages,
    which is vLLM's rule (used to pin down the duplicate-completion difference exactly).
    """

    def __init__(self, lease_duration: float, *, anonymous: bool = False) -> None:
        self.table = PLeaseTable(LeaseTiming.from_lease_duration(lease_duration))
        self.anonymous = anonymous
        self.errors: list = []

    def step(self, step: PStep) -> PObs:
        now = step.t
        released: set[str] = set()
        for req_id in step.finish + step.grant:
            got = self.table.grant(req_id, now)
            if isinstance(got, LeaseEnd):  # buffered completions covered every consumer
                released.add(req_id)
        notifications = [(None if self.anonymous else agent, decode_notification(msg))
                         for agent, msgs in step.notifs.items() for msg in msgs]
        result = self.table.step(now, notifications)
        self.errors.extend(result.errors)
        released |= {e.req_id for e in result.ended if e.outcome is Outcome.RELEASED}
        expired = {e.req_id for e in result.ended if e.outcome is Outcome.EXPIRED}
        live = {lease.req_id: lease.deadline_s for lease in self.table.leases()}
        counted = {lease.req_id: lease.completions for lease in self.table.leases() if lease.completions}
        return PObs(live, frozenset(released), frozenset(expired), counted)


# --------------------------------------------------------------------------------------------
# D side
# --------------------------------------------------------------------------------------------
@dataclass
class DEvent:
    """One D scheduler event for local request ``local``.

    ``kind``: ``enqueue`` (``on_new_request``; ``engine``/``remote`` name P's engine and request id,
    ``complete=False`` leaves ``remote_host`` out), ``schedule`` (``update_state_after_alloc``),
    ``read_done`` (``update_connector_output(finished_recving={local})``), ``finish`` or ``abort``
    (``request_finished`` with FINISHED_STOPPED / FINISHED_ABORTED).
    """

    kind: str
    local: str
    engine: str | None = None
    remote: str | None = None
    complete: bool = True


@dataclass
class DStep:
    t: float
    events: tuple[DEvent, ...] = ()


class VllmD:
    """D driven through vLLM: a real D scheduler (``kv_consumer``); its heartbeat batches are also
    sent through an ``object.__new__`` D worker's ``_send_heartbeats`` to capture the bytes."""

    AGENTS_PER_ENGINE = 2  # P's TP ranks each D worker handshook with

    def __init__(self, v: SimpleNamespace, consumer_config, lease_duration: float, clock: ManualClock) -> None:
        self.v = v
        self.scheduler = make_scheduler(v, consumer_config, D_ENGINE)
        self.worker = make_worker(v, lease_duration)
        self.clock = clock
        self.requests: dict[str, Any] = {}

    def agents(self, engine: str) -> dict[tuple[int, int], str]:
        return {(0, r): f"{engine}/rank{r}" for r in range(self.AGENTS_PER_ENGINE)}

    def apply(self, ev: DEvent) -> None:
        v, s = self.v, self.scheduler
        if ev.kind == "enqueue":
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": ev.engine, "remote_request_id": ev.remote,
                      "remote_block_ids": [[7, 8]], "remote_port": 5600, "tp_size": self.AGENTS_PER_ENGINE}
            if ev.complete:
                params["remote_host"] = "10.0.0.1"
            req = make_request(v, ev.local, params)
            self.requests[ev.local] = req
            s.on_new_request(req)
            # D handshakes with the P engine (done here so _send_heartbeats finds its agents).
            if ev.engine is not None and ev.engine not in self.worker._remote_agents:
                self.worker._remote_agents[ev.engine] = self.agents(ev.engine)
        elif ev.kind == "schedule":
            req = self.requests[ev.local]
            blocks = v.KVCacheBlocks(blocks=([v.KVCacheBlock(3), v.KVCacheBlock(4)],))
            s.update_state_after_alloc(req, blocks, 2 * BLOCK_SIZE)
        elif ev.kind == "read_done":
            s.update_connector_output(v.KVConnectorOutput(finished_recving={ev.local}))
        elif ev.kind in ("finish", "abort"):
            req = self.requests[ev.local]
            req.status = (v.RequestStatus.FINISHED_STOPPED if ev.kind == "finish"
                          else v.RequestStatus.FINISHED_ABORTED)
            s.request_finished(req, ([3, 4],))
        else:
            raise ValueError(ev.kind)

    def step(self, step: DStep) -> tuple[dict[str, frozenset[str]], list[tuple[str, bytes]], dict]:
        """Returns (batches ``{engine: ids}``, bytes sent ``[(agent, msg)]``, the raw metadata map)."""
        self.clock.now = step.t
        with patched_clocks(self.v, self.clock, self.clock):
            for ev in step.events:
                self.apply(ev)
            meta = self.scheduler.build_connector_meta(self.v.SchedulerOutput.make_empty())
            batches = {e: frozenset(info.req_ids) for e, info in meta.heartbeat_by_engine.items()}
            sent_before = len(self.worker.nixl_wrapper.sent)
            self.worker._send_heartbeats(meta)
        return batches, self.worker.nixl_wrapper.sent[sent_before:], meta.heartbeat_by_engine


def random_p_script(rng, lease_duration: float, *, duplicate_senders: bool = False,
                    t0: float = 100.0) -> list[PStep]:
    """A random P script on a quarter-second grid.

    Grants (mostly register+finish in one step, some registered first and finished later), heartbeats
    (from 1-4 D ranks, naming granted ids that may have ended, registered-only ids, unknown ids and
    repeats), completions ``id:n`` (n in 1..3, each from a distinct D rank unless
    ``duplicate_senders``), and step times that often land exactly on a deadline (grant + L or
    heartbeat + E). Ends with a step after every lease must have expired.
    """
    L = lease_duration
    E = L * 2 // 3
    agents = [f"D{i}" for i in range(4)]
    granted: list[str] = []
    registered: list[str] = []
    consumers: dict[str, int] = {}
    unused: dict[str, list[str]] = {}
    used: dict[str, list[str]] = {}
    instants: set[float] = set()
    steps: list[PStep] = []
    t = t0
    counter = 0

    def new_id() -> str:
        nonlocal counter
        counter += 1
        return rng.choice([f"cmpl-{counter}-0", f"chat:{counter}", f"r{counter}-é"])

    for _ in range(rng.randint(8, 24)):
        grant = tuple(new_id() for _ in range(rng.choice([0, 0, 1, 1, 2, 3])))
        register = tuple(new_id() for _ in range(rng.choice([0, 0, 0, 1])))
        finish = tuple(r for r in registered if rng.random() < 0.4)
        registered = [r for r in registered if r not in finish] + list(register)
        for r in grant + finish:
            granted.append(r)
            consumers[r] = rng.choice([1, 1, 2, 3])
            unused[r] = rng.sample(agents, len(agents))
            used[r] = []
            instants.add(t + L)
        notifs: dict[str, list[bytes]] = {}
        for _ in range(rng.choice([0, 1, 1, 2])):  # heartbeats
            pool = granted[-8:] + registered
            ids = rng.sample(pool, min(len(pool), rng.randint(1, 4))) if pool else []
            if rng.random() < 0.3:
                ids.append(f"ghost-{rng.randint(0, 99)}")
            if ids and rng.random() < 0.2:
                ids.append(rng.choice(ids))
            if not ids:
                continue
            msg = ("HB:" + ",".join(ids)).encode()
            for agent in rng.sample(agents, rng.randint(1, len(agents))):
                notifs.setdefault(agent, []).append(msg)
            instants.add(t + E)
        for _ in range(rng.choice([0, 0, 1, 1, 2])):  # completions
            candidates = [r for r in granted[-10:] if unused[r]]
            if not candidates:
                break
            r = rng.choice(candidates)
            if duplicate_senders and used[r] and rng.random() < 0.4:
                agent = rng.choice(used[r])
            else:
                agent = unused[r].pop()
                used[r].append(agent)
            notifs.setdefault(agent, []).append(f"{r}:{consumers[r]}".encode())
        steps.append(PStep(t, grant=grant, register=register, finish=finish, notifs=notifs))
        later = sorted(x for x in instants if x > t)
        if later and rng.random() < 0.35:
            t = later[0]
        else:
            t += rng.choice([0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0])
    steps.append(PStep(t + 2 * L + 1.0))
    return steps


def random_d_script(rng, *, t0: float) -> list[DStep]:
    """A random D script: requests enqueued for engines P-A/P-B/P-C (some sharing a remote id, some
    without ``remote_host``), scheduled, read, finished or aborted at random; steps on a 1/4 s grid."""
    engines = ["P-A", "P-B", "P-C"]
    state: dict[str, str] = {}  # local -> enqueued | scheduled | read | ended
    incomplete: set[str] = set()
    remotes: list[tuple[str, str]] = []
    steps: list[DStep] = []
    t = t0
    counter = 0
    for _ in range(rng.randint(10, 30)):
        events: list[DEvent] = []
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            counter += 1
            local = f"d{counter}"
            if remotes and rng.random() < 0.1:
                engine, remote = rng.choice(remotes)  # two D requests for one P request
            else:
                engine, remote = rng.choice(engines), f"p{counter}"
                remotes.append((engine, remote))
            complete = rng.random() > 0.1
            events.append(DEvent("enqueue", local, engine, remote, complete=complete))
            state[local] = "enqueued"
            if not complete:
                incomplete.add(local)
        for local, st in list(state.items()):
            if any(ev.local == local for ev in events):
                continue
            roll = rng.random()
            if st == "enqueued" and roll < 0.3:
                events.append(DEvent("schedule", local)); state[local] = "scheduled"
            elif st == "scheduled" and roll < 0.3:
                events.append(DEvent("read_done", local)); state[local] = "read"
            elif st == "read" and roll < 0.5:
                events.append(DEvent("finish", local)); state[local] = "ended"
            elif st != "ended" and roll > 0.95 and not (st == "enqueued" and local in incomplete):
                # (an abort before scheduling with remote_host missing crashes vLLM's
                # build_connector_meta: see test_abort_before_schedule_without_remote_host)
                events.append(DEvent("abort", local)); state[local] = "ended"
        steps.append(DStep(t, tuple(events)))
        t += rng.choice([0.25, 0.5, 1.0, 1.0, 1.5, 2.0, 3.0])
    return steps


class ModelD:
    """D driven through leasekit's ``DHeartbeatTracker(timing, last_batch_s=0.0)``."""

    def __init__(self, lease_duration: float) -> None:
        self.tracker = DHeartbeatTracker(LeaseTiming.from_lease_duration(lease_duration), last_batch_s=0.0)

    def step(self, step: DStep) -> dict[str, frozenset[str]]:
        for ev in step.events:
            if ev.kind == "enqueue":
                # vLLM tracks only with every remote field present; the adapter passes None otherwise.
                self.tracker.on_enqueue(ev.local, ev.engine if ev.complete else None, ev.remote)
            elif ev.kind in ("read_done", "finish", "abort"):
                self.tracker.stop(ev.local)
        return {e: frozenset(ids) for e, ids in self.tracker.due(step.t).items()}
