"""The world: one P engine (``p_tp`` ranks) and one D engine (``d_tp`` ranks) on virtual time.

Event order at equal true times: deliveries, then scheduled calls (faults, D enqueues), then D's
step, then P's step (a notification that arrives at a step's instant is drained by that step).
Steps run on a grid rounded to nanoseconds, so ``6.0 - 1.0 >= 5`` holds exactly. P steps every ``p_tick_s``: grant finished
prefills, then per rank drain the inbox and reap (:meth:`PLeaseTable.step`). D steps every
``d_tick_s`` while alive and not stalled: enqueue arrivals (heartbeat tracking starts here), admit
under its rate and slot limits, finish reads (completions to every mapped P rank), send due
heartbeat batches to every mapped P rank. Everything observable is recorded for the checkers.
With ``transfer_mode="push"`` D registers at admission and P WRITEs instead (:mod:`leasekit.sim.push`:
``self.push`` is P's side, ``self.push_d`` D's; both None in pull mode, whose behaviour is unchanged).
"""

from __future__ import annotations

import heapq
import random

from leasekit.lease.codec import Heartbeat, decode_notification, encode_completion, encode_heartbeat
from leasekit.lease.config import LeaseTiming
from leasekit.lease.table import LeaseEnd, PLeaseTable
from leasekit.lease.topology import consumers_per_prefill_rank, prefill_ranks_for
from leasekit.lease.tracker import DHeartbeatTracker
from leasekit.sim.blocks import BlockPool, BlockRef
from leasekit.sim.bus import Message, NotificationBus
from leasekit.sim.push import PushD, PushP
from leasekit.sim.records import LeaseRecord, RequestRecord, RequestSpec, WorldConfig

_DELIVER, _CALL, _D_STEP, _P_STEP = 0, 1, 2, 3


def _next(t: float, tick: float) -> float:
    return round(t + tick, 9)


class World:
    """Build with a :class:`WorldConfig`, add requests and faults, :meth:`run`, then read records.

    ``push_factory``: builds P's push side from the world (push mode; mutants subclass :class:`PushP`).
    Raises ValueError: ``track_on`` or ``config.transfer_mode`` unknown."""

    def __init__(self, config: WorldConfig, *, table_factory=PLeaseTable, tracker_factory=DHeartbeatTracker,
                 track_on: str = "enqueue", push_factory=PushP):
        if track_on not in ("enqueue", "admit"):
            raise ValueError(f"track_on must be 'enqueue' or 'admit', got {track_on!r}")
        if config.transfer_mode not in ("pull", "push"):
            raise ValueError(f"transfer_mode must be 'pull' or 'push', got {config.transfer_mode!r}")
        self.config = config
        self.rng = random.Random(config.seed)
        self.bus = NotificationBus(latency_s=config.latency_s)
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        timing = config.timing()
        if config.fixed_timeout_s is not None:
            timing = LeaseTiming(config.fixed_timeout_s, timing.heartbeat_interval_s, 0)
        self.p_timing = timing
        self.tables = [table_factory(timing) for _ in range(config.p_tp)]
        self.pools = [BlockPool(config.blocks_per_rank) for _ in range(config.p_tp)]
        self.inbox: list[list[Message]] = [[] for _ in range(config.p_tp)]
        self._tracker_factory = tracker_factory
        self.track_on = track_on
        self.requests: dict[str, RequestRecord] = {}
        self.leases: dict[tuple[str, int], LeaseRecord] = {}
        self._block_refs: dict[tuple[str, int], list[BlockRef]] = {}
        self.p_alive = True
        self.p_stalls: list[tuple[float, float]] = []
        self.d_stalls: list[tuple[float, float]] = []
        self.counters: dict[str, int] = {k: 0 for k in (
            "heartbeat_batches", "heartbeat_batches_skipped", "heartbeat_msgs", "heartbeat_send_failures", "completions_sent",
            "transport_failures", "stale_reads_detected", "late_completions", "unknown_heartbeat_ids",
            "decode_errors", "handshake_failures")}
        self.reaper_violations: list[str] = []
        self.p_steps_local: list[float] = []
        self.push = push_factory(self) if config.transfer_mode == "push" else None
        self.push_d = PushD(self) if self.push is not None else None
        self._new_d_engine(0)
        self._schedule(0.0, _P_STEP, None)
        self._schedule(0.0, _D_STEP, self.d_generation)

    # -- set-up ----------------------------------------------------------------------------
    def add(self, spec: RequestSpec) -> RequestRecord:
        """Add a request (before :meth:`run`). Raises ValueError: push-only fields in a pull world."""
        if self.push is None and (spec.d_abort_at_s is not None or spec.write_s is not None or spec.stray_completion):
            raise ValueError(f"{spec.req_id}: d_abort_at_s, write_s and stray_completion need transfer_mode='push'")
        record = RequestRecord(spec)
        self.requests[spec.req_id] = record
        return record

    def at(self, t: float, fn) -> None:
        """Call ``fn(world)`` at true time ``t`` (faults: kill, restart, stalls, rules)."""
        self._schedule(t, _CALL, fn)

    def stall_p(self, start_s: float, duration_s: float) -> None:
        """P takes no step in ``[start, start + duration)`` (a long forward pass, SIGSTOP)."""
        self.p_stalls.append((start_s, start_s + duration_s))

    def stall_d(self, start_s: float, duration_s: float) -> None:
        """D takes no step (no heartbeat, no admission, no completion) in ``[start, start + duration)``."""
        self.d_stalls.append((start_s, start_s + duration_s))

    def kill_d(self, t: float) -> None:
        """SIGKILL D at ``t``: nothing more from this D engine."""
        self.at(t, lambda w: w._kill_d())

    def restart_d(self, t: float) -> None:
        """Start a new D engine (new engine and agent ids) at ``t``, same address."""
        self.at(t, lambda w: w._new_d_engine(t))

    def kill_p(self, t: float) -> None:
        """SIGKILL P at ``t``."""
        self.at(t, lambda w: setattr(w, "p_alive", False))

    # -- running ---------------------------------------------------------------------------
    def run(self, until_s: float) -> "World":
        """Process events up to true time ``until_s``; returns self."""
        while self._events and self._events[0][0] <= until_s:
            t, kind, _, payload = heapq.heappop(self._events)
            self.now = t
            if kind == _DELIVER:
                rank, msg = payload
                if msg.kind == "push_reg":
                    self.push.on_reg(rank, msg, t)  # P's writer thread, at once
                else:
                    self.inbox[rank].append(msg)
                self.bus.stats["delivered"] += 1
                self._note_arrival(rank, msg, t)
            elif kind == _P_STEP:
                self._p_step(t)
            elif kind == _D_STEP:
                self._d_step(t, payload)
            else:
                payload(self)
        self.now = until_s
        return self

    # -- P ---------------------------------------------------------------------------------
    def _p_step(self, t: float) -> None:
        if not self.p_alive:
            return
        nxt = _next(t, self.config.p_tick_s)
        if any(a <= t < b for a, b in self.p_stalls):
            nxt = max(b for a, b in self.p_stalls if a <= t < b)  # resume exactly at the stall's end
            self._schedule(nxt, _P_STEP, None)
            return
        local = self.config.p_clock.local(t)
        self.p_steps_local.append(local)
        for record in self.requests.values():
            spec = record.spec
            if record.granted_true is None and not record.cancelled_before_grant and spec.prefill_end_s <= t:
                self._grant(record, t, local)
        for rank, table in enumerate(self.tables):
            messages, self.inbox[rank] = self.inbox[rank], []
            decoded = []
            for msg in messages:
                result = decode_notification(msg.payload)
                if isinstance(result, Heartbeat):
                    for req_id in result.req_ids:
                        lease = self.leases.get((req_id, rank))
                        if lease is not None and lease.end_true is None:
                            lease.hb_processed_local.append(local)
                decoded.append((msg.src, result))
            result = self._table_step(table, local, decoded)
            self.counters["unknown_heartbeat_ids"] += len(result.unknown_heartbeat_ids)
            self.counters["late_completions"] += len(result.late_completions)
            self.counters["decode_errors"] += len(result.errors)
            for end in result.ended:
                self._on_end(rank, end, t, local)
            stale = [l.req_id for l in table.leases() if l.deadline_s <= local]
            if stale:
                self.reaper_violations.append(f"t={t:.3f} rank {rank}: expired leases left after reap: {stale}")
        if self.push is not None:
            self.push.p_step(t, local)  # WRITEs done since: after the drain and the reap
        self._schedule(nxt, _P_STEP, None)

    def _table_step(self, table, local, decoded):
        if self.config.fixed_timeout_s is not None:  # the old behaviour: heartbeats do nothing
            decoded = [(src, m) for src, m in decoded if not isinstance(m, Heartbeat)]
        if self.push is not None:
            decoded = self.push.table_notifications(decoded)
        return table.step(local, decoded)

    def _grant(self, record: RequestRecord, t: float, local: float) -> None:
        spec = record.spec
        if spec.cancel_at_s is not None and spec.cancel_at_s <= spec.prefill_end_s:
            record.cancelled_before_grant = True  # freed with the step output, never leased (K03)
            return
        record.granted_true = t
        for rank, (table, pool) in enumerate(zip(self.tables, self.pools)):
            refs = pool.allocate(spec.req_id, spec.blocks)
            if refs is None:
                raise RuntimeError(f"P rank {rank} out of blocks: raise blocks_per_rank")
            self._block_refs[(spec.req_id, rank)] = refs
            self.leases[(spec.req_id, rank)] = LeaseRecord(spec.req_id, rank, t, local)
            granted = table.grant(spec.req_id, local, kv_blocks=spec.blocks)
            if isinstance(granted, LeaseEnd):
                self._on_end(rank, granted, t, local)
        if spec.route_delay_s is not None and (spec.cancel_at_s is None or spec.cancel_at_s > t):
            self._route_at(record, t + spec.route_delay_s)

    def _on_end(self, rank: int, end: LeaseEnd, t: float, local: float) -> None:
        lease = self.leases.get((end.req_id, rank))
        if lease is None or (self.push is not None and self.push.hold_free(rank, end, t, local)):
            return
        lease.frees += 1
        if lease.end_true is None:
            lease.end_true, lease.end_local, lease.outcome = t, local, end.outcome
        self.pools[rank].free(end.req_id, self._block_refs.get((end.req_id, rank), []))

    def _note_arrival(self, rank: int, msg: Message, t: float) -> None:
        if msg.kind != "heartbeat":
            return
        result = decode_notification(msg.payload)
        if isinstance(result, Heartbeat):
            for req_id in result.req_ids:
                lease = self.leases.get((req_id, rank))
                if lease is not None and lease.end_true is None:
                    lease.hb_arrivals_true.append(t)

    # -- D ---------------------------------------------------------------------------------
    def _new_d_engine(self, t: float) -> None:
        self.d_generation = getattr(self, "d_generation", -1) + 1
        self.d_engine = f"D{self.d_generation}"
        self.d_alive = True
        self.tracker = self._tracker_factory(self.config.timing())
        self.waiting: list[RequestRecord] = []
        self.running: list[tuple[float, RequestRecord]] = []
        self.handshaken = self.config.d_handshaken and self.d_generation == 0
        self._handshake_done_at: float | None = None
        self._handshake_attempts = 0
        self._last_admit = float("-inf")
        if t > 0:
            self._schedule(t, _D_STEP, self.d_generation)

    def _kill_d(self) -> None:
        self.d_alive = False
        for record in self.waiting + [r for _, r in self.running]:
            self._conclude(record, "lost", self.now)
        self.waiting, self.running = [], []

    def _route_at(self, record: RequestRecord, t: float) -> None:
        def enqueue(world: "World") -> None:
            if not world.d_alive:
                world._conclude(record, "lost", world.now)
                return
            record.enqueued_true = world.now
            world.waiting.append(record)
            if world.track_on == "enqueue":
                world._track(record)
        self.at(t, enqueue)

    def _track(self, record: RequestRecord) -> None:
        spec = record.spec
        self.tracker.on_enqueue(spec.d_local_id or spec.req_id, "P0", spec.req_id)

    def _d_step(self, t: float, generation: int) -> None:
        if generation != self.d_generation or not self.d_alive:
            return
        nxt = _next(t, self.config.d_tick_s)
        if any(a <= t < b for a, b in self.d_stalls):
            nxt = max(b for a, b in self.d_stalls if a <= t < b)
            self._schedule(nxt, _D_STEP, generation)
            return
        local = self.config.d_clock.local(t)
        if not self.handshaken and (self.waiting or self.running):
            self._handshake(t)
        self._finish_reads(t) if self.push_d is None else self.push_d.step(t)
        if self.handshaken:
            self._admit(t)
        for engine, ids in self.tracker.due(local).items():
            if not self.handshaken:  # vLLM: the interval is used up, the batch skipped (handshake pending)
                self.counters["heartbeat_batches_skipped"] += 1
                continue
            self.counters["heartbeat_batches"] += 1
            payload = encode_heartbeat(ids)
            for d_rank in range(self.config.d_tp):
                for p_rank in prefill_ranks_for(d_rank, self.config.d_tp, self.config.p_tp):
                    self._send(d_rank, p_rank, payload, "heartbeat", t)
        self._schedule(nxt, _D_STEP, generation)

    def _handshake(self, t: float) -> None:
        """Side-channel handshake with P: ``handshake_s`` per attempt, success iff P is alive when it
        completes; after ``handshake_retries`` failed attempts every waiting request fails (bounded)."""
        if self._handshake_done_at is None:
            self._handshake_done_at = t + self.config.handshake_s
            return
        if t < self._handshake_done_at:
            return
        self._handshake_done_at = None
        if self.p_alive:
            self.handshaken = True
            return
        self._handshake_attempts += 1
        self.counters["handshake_failures"] += 1
        if self._handshake_attempts < self.config.handshake_retries:
            return
        for record in self.waiting:
            self._conclude(record, "failed", t)
            self.tracker.stop(record.spec.d_local_id or record.spec.req_id)
        self.waiting = []
        self._handshake_attempts = 0

    def _admit(self, t: float) -> None:
        while self.waiting and len(self.running) < self.config.max_running and t - self._last_admit >= self.config.admit_every_s:
            record = self.waiting.pop(0)
            self._last_admit = t
            record.admitted_true = t
            if self.track_on == "admit":
                self._track(record)
            if self.push_d is not None:
                self.push_d.admit(record, t)
                continue
            done_at = t if record.spec.prefix_hit else t + self.config.read_s
            self.running.append((done_at, record))
            if record.spec.prefix_hit:
                self._finish_reads(t)

    def _finish_reads(self, t: float) -> None:
        keep = []
        for done_at, record in self.running:
            if done_at > t:
                keep.append((done_at, record))
                continue
            spec = record.spec
            record.read_done_true = t
            self.tracker.stop(spec.d_local_id or spec.req_id)
            if spec.read_fails:
                record.read_result = "transport_error"
                self.counters["transport_failures"] += 1
                self._conclude(record, "transport_failed", t)
                continue  # vLLM: blocks marked invalid, recompute; P is not notified
            record.read_result = "ok" if spec.prefix_hit else self._read(spec)
            if record.read_result == "ok":
                self._conclude(record, "served", t)
            else:
                self._conclude(record, "stale_detected", t)
                self.counters["stale_reads_detected"] += 1
            n = consumers_per_prefill_rank(self.config.d_tp, self.config.p_tp)
            payload = encode_completion(spec.remote_id, n)
            for d_rank in range(self.config.d_tp):
                for p_rank in prefill_ranks_for(d_rank, self.config.d_tp, self.config.p_tp):
                    self.counters["completions_sent"] += 1
                    self._send(d_rank, p_rank, payload, "completion", t)
        self.running = keep

    def _conclude(self, record: RequestRecord, outcome: str, t: float) -> None:
        if record.d_outcome is None:
            record.d_outcome, record.d_outcome_true = outcome, t

    def _read(self, spec: RequestSpec) -> str:
        """What D's read sees on every P rank it reads (the worst wins): generations decide."""
        results = []
        for d_rank in range(self.config.d_tp):
            for p_rank in prefill_ranks_for(d_rank, self.config.d_tp, self.config.p_tp):
                refs = self._block_refs.get((spec.remote_id, p_rank))
                if spec.bad_blocks or refs is None:
                    results.append("invalid")  # out-of-range ids, or params naming no grant
                    continue
                results.append(self.pools[p_rank].read(spec.remote_id, refs))
        for worst in ("invalid", "reused", "freed"):
            if worst in results:
                return worst
        return "ok"

    def _send(self, d_rank: int, p_rank: int, payload: bytes, kind: str, t: float) -> None:
        self._seq += 1
        msg = Message(f"{self.d_engine}-r{d_rank}", f"P0-r{p_rank}", payload, t, kind, self._seq)
        delays = self.bus.route(msg, self.rng)
        if kind == "heartbeat":
            self.counters["heartbeat_msgs"] += 1
            if delays is None:  # the sender saw the failure (NIXL send_notif raised)
                self.counters["heartbeat_send_failures"] += 1
        if delays is None:
            return
        for delay in delays:
            self._schedule(t + delay, _DELIVER, (p_rank, msg))

    # -- events ----------------------------------------------------------------------------
    def _schedule(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    # -- summaries -------------------------------------------------------------------------
    def pinned_blocks(self) -> list[int]:
        """Blocks pinned per P rank right now."""
        return [pool.pinned for pool in self.pools]

    def lease(self, req_id: str, rank: int = 0) -> LeaseRecord:
        """The lease record of ``req_id`` on ``rank`` (KeyError if never granted)."""
        return self.leases[(req_id, rank)]
