"""Push mode in the sim: D registers its KV blocks (``PUSH_REG``), P WRITEs the leased blocks into them.

The model of vLLM's NixlPushConnector (vllm 0.32.0/0.33.0 ``kv_connector/v1/nixl/push_scheduler.py``,
``push_worker.py``) with LeaseKit's P-side rules (``leasekit/vllm/push.py``, ``leasekit/lease/pushreg.py``):

- P grants a lease at the end of prefill, D heartbeats it from enqueue, P reaps it, all as in pull mode
  (:mod:`leasekit.sim.world`).
- D, at admission (``update_state_after_alloc``), allocates the request's blocks in its engine's pool (block
  ids are the scheduler's, shared by D's TP ranks) and every D rank sends one ``PUSH_REG`` (msgpack, as vLLM)
  to each P rank it talks to. A prefix hit registers nothing (``num_external_tokens <= 0``). D does not read.
- P's ``nixl-push-writer`` thread decides each registration when it arrives (the thread is not held by P's
  forward passes, :meth:`World.stall_p`; it dies with P) through :class:`PushRegGuard`: only for a lease P
  holds now, only the first per lease; unknown ones are held ``max(H, 2 s)`` then dropped. An accepted one
  issues the WRITE at once; it completes ``write_s`` later.
- At its completion the WRITE reads P's blocks (``source``: did P free them first?) and lands in D's
  registered blocks (``dest``: had D given up and another request taken them?), or fails if D's engine died
  or was replaced (P does not release then: the lease expires, as vLLM's ``_send_failures``).
- P's engine step, after the drain and the reap (vLLM ``get_transfer_results``: ``_get_new_notifs``, the reap,
  then ``_pop_done_transfers`` on ``_sending_transfers``), looks at the WRITEs done since: a live lease is
  released by its own WRITE; one that already ended makes a late write ("Expired requests were already
  reported, even if their WRITEs finish later": P freed the blocks at the expiry). A read completion sent to
  a push P is dropped (``push_completion``: P frees only on its WRITE, vllm 0.33.0 and LeaseKit).
- D notices the last WRITE at its next step (``finished_recving``): stops heartbeating the request, serves
  it, frees its blocks ``decode_s`` later. D gives up on a request (``d_abort_at_s``, or ``push_timeout_s``
  after its registration): frees its D blocks at once and stops heartbeating it; a WRITE landing later hits
  freed or reused D blocks (recorded).

:class:`PushP` is the P side (subclassed by the planted mutants, ``tests/sim/mutants.py``); :class:`PushD`
the D side. ``world`` is the :class:`leasekit.sim.world.World` they belong to (not imported: world imports
this module). Everything observed goes to :class:`~leasekit.sim.records.PushRecords` (``world.push.records``).
"""

from __future__ import annotations

import math
from typing import Any

from leasekit.lease.codec import Completion, encode_completion
from leasekit.lease.pushreg import PUSH_REG_PREFIX, PushRegError, PushRegGuard, decode_push_reg
from leasekit.lease.table import LeaseEnd
from leasekit.lease.topology import consumers_per_prefill_rank, prefill_ranks_for
from leasekit.sim.blocks import BlockPool, BlockRef
from leasekit.sim.bus import Message
from leasekit.sim.records import PushRecords, RequestRecord, WriteRecord

D_HOST = "10.0.0.2"
"""D's side-channel address in every registration (the one address P's guard allows)."""
D_PORT = 5600
MIN_HOLD_S = 2.0
"""A registration waits at least this long (seconds) for its lease (``leasekit.vllm.push.MIN_HOLD_S``)."""
MAX_REG_BYTES = 1 << 16
"""Size ceiling of one registration (bytes) for the guard."""


def _encode(obj: dict) -> bytes:
    import msgspec  # vLLM's dependency, as vLLM encodes registrations; imported here so the sim imports without it

    return msgspec.msgpack.encode(obj)


class PushP:
    """P's push side over a :class:`~leasekit.sim.world.World` with ``transfer_mode="push"``.

    One :class:`PushRegGuard` per P rank (``live``: the world's lease record for that rank has not ended;
    ``allowed``: only :data:`D_HOST`). Hooks the world calls: :meth:`on_reg` (a registration delivered),
    :meth:`table_notifications` (what P's lease table sees of a step's notifications), :meth:`hold_free`
    (a lease ended: may it be freed now?), :meth:`p_step` (after every rank's drain and reap).
    """

    def __init__(self, world: Any):
        self.world = world
        self.records = PushRecords()
        hold_s = max(world.config.timing().heartbeat_interval_s, MIN_HOLD_S)
        self.guards = [self.make_guard(rank, hold_s) for rank in range(world.config.p_tp)]
        self.pending: list[list[WriteRecord]] = [[] for _ in range(world.config.p_tp)]  # done, not yet seen by P

    def make_guard(self, rank: int, hold_s: float) -> PushRegGuard:
        """The registration guard of P rank ``rank`` (``hold_s`` seconds on P's clock)."""
        return PushRegGuard(live=lambda req_id: self.live(rank, req_id), allowed=lambda host: host == D_HOST,
                            hold_s=hold_s, max_bytes=MAX_REG_BYTES)

    def live(self, rank: int, req_id: str) -> str | None:
        """The lease P rank ``rank`` holds now for ``req_id`` (its id), or None (never granted, or ended)."""
        lease = self.world.leases.get((req_id, rank))
        return req_id if lease is not None and lease.end_true is None else None

    # -- writer thread -------------------------------------------------------------------------------
    def on_reg(self, rank: int, msg: Message, t: float) -> None:
        """A ``PUSH_REG`` delivered to P rank ``rank`` at true ``t``: the guard decides; accepted -> WRITE."""
        if not self.world.p_alive:
            return
        local = self.world.config.p_clock.local(t)
        reg = decode_push_reg(msg.payload, max_bytes=MAX_REG_BYTES)
        self._decide(rank, [], t, local)  # held ones first, so what follows is this registration's alone
        held_before = self.guards[rank].held
        accepted, dropped = self._decide(rank, [(msg.src, msg.payload)], t, local)
        decision = ("accepted" if accepted else "held" if self.guards[rank].held > held_before
                    else dropped[-1][0] if dropped else "none")
        self.records.reg_arrivals.append((t, rank, None if isinstance(reg, PushRegError) else reg.request_id, decision))

    def _decide(self, rank: int, batch: list[tuple[str, bytes]], t: float, local: float) -> tuple[list, list]:
        """Run P rank ``rank``'s guard over ``batch`` (and its held registrations): count the drops, issue a
        WRITE for each accepted one. Returns the guard's ``(accepted, dropped)``."""
        accepted, dropped = self.guards[rank].filter(batch, local)
        for reason, _agent, _detail in dropped:
            self.records.reg_drops[reason] += 1
        for _agent, _msg, push_reg, lease_id in accepted:
            self.issue(rank, lease_id, push_reg.decode_engine_id, t, local)
        return accepted, dropped

    def issue(self, rank: int, lease_id: str, d_engine: str, t: float, local: float) -> WriteRecord:
        """Issue P rank ``rank``'s WRITE of ``lease_id``'s blocks into D engine ``d_engine``'s registered ones."""
        world = self.world
        spec = world.requests[lease_id].spec
        duration = world.config.write_s if spec.write_s is None else spec.write_s
        generation = int(d_engine.lstrip("D"))  # the sim names D engines D<generation>
        write = WriteRecord(lease_id, rank, generation, t, local, duration)
        self.records.writes.append(write)
        world.at(t + duration, lambda w: self.complete(write, w.now))
        return write

    def complete(self, write: WriteRecord, t: float) -> None:
        """The WRITE's transfer ends at true ``t``: read P's source blocks, land in D (or fail)."""
        world = self.world
        write.done_true = t
        if not world.p_alive:
            write.outcome = "p_dead"
            return
        refs = world._block_refs.get((write.req_id, write.rank), [])
        write.source = world.pools[write.rank].read(write.req_id, refs)
        target = world.push_d.registered.get((write.d_generation, write.req_id))
        if not world.d_alive or write.d_generation != world.d_generation or target is None:
            write.outcome = "failed"
        else:
            write.outcome = "landed"
            world.push_d.land(write, target, t)
        self.pending[write.rank].append(write)

    # -- engine thread -------------------------------------------------------------------------------
    def table_notifications(self, decoded: list) -> list:
        """What P's lease table sees of one step's ``(sender, message)`` list: read completions are dropped
        (counted ``completions_dropped``): P frees on its own WRITE only."""
        kept = [(src, m) for src, m in decoded if not isinstance(m, Completion)]
        self.records.counters["completions_dropped"] += len(decoded) - len(kept)
        return kept

    def hold_free(self, rank: int, end: LeaseEnd, t: float, local: float) -> bool:
        """A lease ended on ``rank`` (released, expired): the guard forgets it; True would postpone the free
        (never, here: P frees at the expiry even with a WRITE in flight, as vLLM)."""
        self.guards[rank].forget(end.req_id)
        return False

    def p_step(self, t: float, local: float) -> None:
        """After every rank's drain and reap: time out held registrations, then each WRITE done since."""
        for rank in range(len(self.guards)):
            self._decide(rank, [], t, local)
            done, self.pending[rank] = self.pending[rank], []
            for write in done:
                write.observed_local = local
                self.observe(write, t, local)

    def observe(self, write: WriteRecord, t: float, local: float) -> None:
        """P sees ``write`` done: a failed one does nothing; a live lease is released; an ended one is late."""
        if write.outcome == "failed":
            write.p_view = "failed"
            return
        if self.live(write.rank, write.req_id) is None:
            write.p_view = "late"
            self.records.late_writes.append(write)
            return
        write.p_view = "released"
        self.release(write.rank, write.req_id, t, local)

    def release(self, rank: int, req_id: str, t: float, local: float) -> None:
        """End ``req_id``'s lease on ``rank`` as released and free its blocks (the table's and the world's)."""
        table = self.world.tables[rank]
        end = getattr(table, "table", table).release(req_id, local)
        if hasattr(table, "forget"):
            table.forget(req_id)  # PLeaseKeeping: its heartbeat binding
        if end is not None:
            self.world._on_end(rank, end, t, local)


class PushD:
    """D's push side: per-engine block pools, registration, landing, serving and giving up."""

    def __init__(self, world: Any):
        self.world = world
        self.pools: dict[int, BlockPool] = {}
        self.registered: dict[tuple[int, str], tuple[str, list[BlockRef]]] = {}  # (engine, req id) -> owner, refs
        self._landed: dict[tuple[int, str], set[int]] = {}

    def pool(self, generation: int) -> BlockPool:
        """D engine ``generation``'s block pool (``blocks_per_rank`` blocks; a restarted D has a fresh one)."""
        if generation not in self.pools:
            self.pools[generation] = BlockPool(self.world.config.blocks_per_rank)
        return self.pools[generation]

    def admit(self, record: RequestRecord, t: float) -> None:
        """D admits ``record`` at ``t``: allocate, register with every P rank, wait for the WRITE."""
        world, spec = self.world, record.spec
        local_id = spec.d_local_id or spec.req_id
        if spec.prefix_hit:  # nothing to receive: no registration, P's lease runs out (vLLM push_scheduler)
            world.tracker.stop(local_id)
            world._conclude(record, "served", t)
            return
        refs = self.pool(world.d_generation).allocate(local_id, spec.blocks)
        if refs is None:
            raise RuntimeError("D out of blocks: raise blocks_per_rank")
        self.registered[(world.d_generation, spec.req_id)] = (local_id, refs)
        record.registered_true = t
        payload = PUSH_REG_PREFIX + _encode({
            "request_id": spec.req_id, "decode_engine_id": world.d_engine, "decode_host": D_HOST,
            "decode_port": D_PORT, "decode_tp_size": world.config.d_tp, "local_block_ids": [r.block for r in refs],
            "remote_engine_id": "P0", "remote_host": "10.0.0.1", "remote_port": 5500,
            "remote_tp_size": world.config.p_tp})
        n = consumers_per_prefill_rank(world.config.d_tp, world.config.p_tp)
        for d_rank in range(world.config.d_tp):
            for p_rank in prefill_ranks_for(d_rank, world.config.d_tp, world.config.p_tp):
                self.world.push.records.regs_sent.append((t, spec.req_id, d_rank, p_rank))
                world._send(d_rank, p_rank, payload, "push_reg", t)
                if spec.stray_completion:
                    world._send(d_rank, p_rank, encode_completion(spec.remote_id, n), "completion", t)
        world.running.append((math.inf, record))

    def land(self, write: WriteRecord, target: tuple[str, list[BlockRef]], t: float) -> None:
        """P rank ``write.rank``'s WRITE lands in D's registered blocks at ``t`` (D may have given up)."""
        owner, refs = target
        write.dest = self.pool(write.d_generation).read(owner, refs)
        record = self.world.requests[write.req_id]
        if write.dest != "ok" or record.d_outcome is not None:
            self.world.push.records.counters["d_late_writes"] += 1  # D no longer waits for it
            if write.dest == "reused":
                self.world.push.records.reused_d_writes.append(write)
            return
        record.push_sources.append(write.source)
        landed = self._landed.setdefault((write.d_generation, write.req_id), set())
        landed.add(write.rank)
        if len(landed) == self.world.config.p_tp and record.landed_true is None:
            record.landed_true = t

    def step(self, t: float) -> None:
        """D's step in push mode (in place of pull mode's read completions): serve the requests whose WRITEs
        all landed, give up on aborted and timed-out ones (waiting ones included)."""
        world, config = self.world, self.world.config
        keep = []
        for done_at, record in world.running:
            spec = record.spec
            if record.landed_true is not None and record.landed_true <= t:
                world.tracker.stop(spec.d_local_id or spec.req_id)
                world._conclude(record, "served", t)
                self._free_at(record, t + config.decode_s)
            elif spec.d_abort_at_s is not None and spec.d_abort_at_s <= t:
                self._give_up(record, "aborted", t)
            elif record.registered_true is not None and record.registered_true + config.push_timeout_s <= t:
                self._give_up(record, "timed_out", t)
            else:
                keep.append((done_at, record))
        world.running = keep
        for record in [r for r in world.waiting if r.spec.d_abort_at_s is not None and r.spec.d_abort_at_s <= t]:
            world.waiting.remove(record)
            world.tracker.stop(record.spec.d_local_id or record.spec.req_id)
            world._conclude(record, "aborted", t)

    def _give_up(self, record: RequestRecord, outcome: str, t: float) -> None:
        self.world.tracker.stop(record.spec.d_local_id or record.spec.req_id)
        self.world._conclude(record, outcome, t)
        self._free(self.world.d_generation, record)

    def _free_at(self, record: RequestRecord, t: float) -> None:
        generation = self.world.d_generation
        self.world.at(t, lambda w: self._free(generation, record))

    def _free(self, generation: int, record: RequestRecord) -> None:
        entry = self.registered.get((generation, record.spec.req_id))
        if entry is not None:
            self.pool(generation).free(*entry)
