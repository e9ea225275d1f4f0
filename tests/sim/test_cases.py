"""CASES.md K01-K13 in virtual time, each over a family of timings (not one timeline).

Every world also passes the always-true invariants (bounded and not-premature reclaim, reaper
completeness, fail closed, idempotent release) and, once quiet, conservation.
"""

import itertools
import math

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.table import LeaseEnd, Outcome, PLeaseTable
from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim import invariants as inv
from leasekit.sim.blocks import BlockPool
from leasekit.sim.bus import delay_when, drop_heartbeats, fail_sends


def assert_invariants(world: World, quiescent: bool = True) -> None:
    assert inv.check_all(world, quiescent=quiescent) == {}


def first_step_at_or_after(world: World, t_local: float) -> float:
    return min(s for s in world.p_steps_local if s >= t_local - 1e-9)


# -- K01 D crashes after a few heartbeats ------------------------------------------------------
@pytest.mark.parametrize("L", [6, 12, 30, 60])
@pytest.mark.parametrize("kill_after_heartbeats", [1, 3, 5])
@pytest.mark.parametrize("latency, tick", [(0.0, 0.1), (0.004, 0.1), (0.002, 0.25)])
def test_k01_kill_after_heartbeats(L, kill_after_heartbeats, latency, tick):
    t = LeaseTiming.from_lease_duration(L)
    H, E = t.heartbeat_interval_s, t.extension_s
    kill = 1 + (kill_after_heartbeats - 1) * H + H / 5  # between heartbeat k and k+1
    w = World(WorldConfig(lease_duration_s=L, latency_s=latency, p_tick_s=tick, max_running=0))
    w.add(RequestSpec("R", prefill_end_s=0.0, blocks=8, route_delay_s=1.0))
    w.kill_d(kill)
    w.run(3 * L + 10)
    lease = w.lease("R")
    assert lease.outcome is Outcome.EXPIRED
    assert len(lease.hb_processed_local) == kill_after_heartbeats
    point = max(0 + L, lease.hb_processed_local[-1] + E)
    assert lease.end_local == first_step_at_or_after(w, point)
    assert w.tables[0].counters["expired"] == 1 and w.tables[0].counters["completions"] == 0
    assert_invariants(w)


def test_k01_exact_timeline_and_the_480s_control():
    w = World(WorldConfig(latency_s=0.0, max_running=0))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.0))
    w.kill_d(12.0)
    w.run(100)
    assert w.lease("R").hb_processed_local == [1.0, 6.0, 11.0]
    assert w.lease("R").end_local == 31.0  # max(0 + 30, 11 + 20)
    variant = World(WorldConfig(latency_s=0.0, max_running=0))
    variant.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.0))
    variant.kill_d(16.5)  # after the t=16 heartbeat
    variant.run(100)
    assert variant.lease("R").end_local == 36.0
    control = World(WorldConfig(latency_s=0.0, max_running=0, fixed_timeout_s=480))
    control.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.0))
    control.kill_d(12.0)
    control.run(600)
    assert control.lease("R").end_local == 480.0
    assert_invariants(w), assert_invariants(variant), assert_invariants(control)


# -- K02 D only overloaded: a long waiting queue -------------------------------------------------
@pytest.mark.parametrize("L, admit_every", [(30, 2.0), (30, 1.5), (60, 3.0)])
def test_k02_long_queue_survives_on_heartbeats(L, admit_every):
    n = 100
    w = World(WorldConfig(lease_duration_s=L, admit_every_s=admit_every, max_running=1 << 20, latency_s=0.002))
    for k in range(n):
        w.add(RequestSpec(f"R{k:03d}", prefill_end_s=k / n, route_delay_s=0.05))
    w.run(n * admit_every + 3 * L)
    assert sum(r.d_outcome == "served" for r in w.requests.values()) == n
    assert sum(t.counters["expired"] for t in w.tables) == 0
    assert_invariants(w)


@pytest.mark.parametrize("L, admit_every", [(30, 2.0), (60, 3.0)])
def test_k02_heartbeating_only_once_scheduled_is_caught(L, admit_every):
    n = 100
    w = World(WorldConfig(lease_duration_s=L, admit_every_s=admit_every, latency_s=0.002), track_on="admit")
    for k in range(n):
        w.add(RequestSpec(f"R{k:03d}", prefill_end_s=k / n, route_delay_s=0.05))
    w.run(n * admit_every + 3 * L)
    expired = {int(l.req_id[1:]) for l in w.leases.values() if l.outcome is Outcome.EXPIRED}
    # request k is read at about k * admit_every: it expires iff that is past its lease (the exact
    # edge depends on where D's global heartbeat timer stands: +-1 s)
    assert {k for k in range(n) if k * admit_every > L + 1} <= expired <= {k for k in range(n) if k * admit_every > L - 1}
    assert inv.false_expiries(w)  # the suite flags it
    assert inv.fail_closed(w) == []  # and every one of those late reads was detected


def test_k02_fixed_120s_timeout_expires_the_tail_and_every_late_read_is_detected():
    n = 100
    w = World(WorldConfig(admit_every_s=2.0, latency_s=0.002, fixed_timeout_s=120))
    for k in range(n):
        w.add(RequestSpec(f"R{k:03d}", prefill_end_s=k / n, route_delay_s=0.05))
    w.run(n * 2.0 + 200)
    expired = {int(l.req_id[1:]) for l in w.leases.values() if l.outcome is Outcome.EXPIRED}
    assert {k for k in range(n) if k * 2.0 > 121} <= expired <= {k for k in range(n) if k * 2.0 > 119}
    for k in expired:
        assert w.requests[f"R{k:03d}"].d_outcome == "stale_detected"  # never served silently
    assert_invariants(w)


# -- K03 cancel while P runs the last prefill step ----------------------------------------------
@pytest.mark.parametrize("prefill_end, cancel_at", [(2.0, 0.5), (1.0, 0.9), (3.0, 0.0)])
def test_k03_cancel_during_last_prefill_step_never_leases(prefill_end, cancel_at):
    w = World(WorldConfig(latency_s=0.001))
    for i in range(10):
        w.add(RequestSpec(f"C{i}", prefill_end_s=prefill_end, cancel_at_s=cancel_at, route_delay_s=0.01))
    w.add(RequestSpec("NEW", prefill_end_s=prefill_end + 1.0, route_delay_s=0.01))
    w.run(prefill_end + 5)
    assert all(w.requests[f"C{i}"].cancelled_before_grant for i in range(10))
    assert not any(key[0].startswith("C") for key in w.leases)
    assert w.requests["NEW"].d_outcome == "served"
    assert w.pinned_blocks() == [0]
    assert_invariants(w)


@pytest.mark.parametrize("L, prefill_end, cancel_after", [(30, 2.0, 0.5), (12, 1.0, 0.1), (60, 5.0, 2.0)])
def test_k03_cancel_after_prefill_is_reclaimed_by_grant_plus_L(L, prefill_end, cancel_after):
    w = World(WorldConfig(lease_duration_s=L, latency_s=0.001))
    w.add(RequestSpec("R", prefill_end_s=prefill_end, cancel_at_s=prefill_end + cancel_after, route_delay_s=None))
    w.run(prefill_end + 2 * L)
    lease = w.lease("R")
    assert lease.outcome is Outcome.EXPIRED
    assert lease.end_local == first_step_at_or_after(w, lease.granted_local + L)
    assert_invariants(w)


# -- K04 races between finish, abort, expiry and notifications -----------------------------------
OPS = ("abort", "expire", "done", "duplicate_done")


@pytest.mark.parametrize("order", list(itertools.permutations(OPS)))
@pytest.mark.parametrize("consumers", [1, 2])
def test_k04_every_ordering_frees_exactly_once(order, consumers):
    timing = LeaseTiming.from_lease_duration(30)
    table, pool = PLeaseTable(timing), BlockPool(64)
    refs = pool.allocate("R", 8)
    frees = 0

    def free(result):
        nonlocal frees
        end = result.end if hasattr(result, "end") else result
        if isinstance(end, LeaseEnd):
            frees += 1
            pool.free("R", refs)
        elif isinstance(result, list):
            for e in result:
                frees += 1
                pool.free(e.req_id, refs)

    free(table.grant("R", 0.0, kv_blocks=8))
    now = 0.0
    for op in order:
        now += 1.0
        if op == "abort":
            free(table.abort("R", now))
        elif op == "expire":
            now = max(now, 30.0)
            free(table.reap(now))
        elif op == "done":
            for rank in range(consumers):
                free(table.completion("R", consumers, now, sender=f"D-r{rank}"))
        else:
            free(table.completion("R", consumers, now, sender="D-r0"))
    assert frees == 1
    assert pool.pinned == 0 and pool.violations["double_free"] == 0
    assert len(table) == 0


# -- K05 reaper completeness ---------------------------------------------------------------------
@pytest.mark.parametrize("b_offset, hb_every", [(1.0, 5.0), (0.5, 1.0), (7.0, 2.5)])
def test_k05_a_lease_behind_a_live_head_is_still_reaped(b_offset, hb_every):
    table = PLeaseTable(LeaseTiming.from_lease_duration(30))
    table.grant("A", 0.0)
    table.grant("B", b_offset)
    reaped_b_at = None
    t = 0.0
    while t <= 300:
        t = round(t + 0.1, 9)
        if abs(t / hb_every - round(t / hb_every)) < 1e-9:
            table.heartbeat(["A"], t)
        for end in table.reap(t):
            if end.req_id == "B":
                reaped_b_at = t
        assert all(lease.deadline_s > t for lease in table.leases())
    assert reaped_b_at == pytest.approx(math.ceil((b_offset + 30) * 10 - 1e-6) / 10)
    assert "A" in table


# -- K06 completion before registration; n > 1 siblings ------------------------------------------
@pytest.mark.parametrize("early, grant", [(0.100, 0.150), (0.0, 5.0), (1.0, 1.0)])
def test_k06_completion_before_grant_is_buffered_and_matched(early, grant):
    table = PLeaseTable(LeaseTiming.from_lease_duration(30))
    assert table.completion("R", 1, early, sender="D-r0").kind == "buffered"
    result = table.grant("R", grant)
    assert isinstance(result, LeaseEnd) and result.outcome is Outcome.RELEASED and result.at_s == grant
    assert len(table) == 0


@pytest.mark.parametrize("rate_per_s, n", [(10, 4), (5, 8)])
def test_k06_parallel_sampling_siblings_end_promptly_and_pins_stay_bounded(rate_per_s, n):
    w = World(WorldConfig(latency_s=0.002))
    peak = 0
    requests = 0
    for i in range(rate_per_s * 60):
        t = i / rate_per_s
        for s in range(n):
            w.add(RequestSpec(f"R{i}.{s}", prefill_end_s=t, blocks=4, route_delay_s=0.01, prefix_hit=s > 0))
            requests += 1
    for step in range(0, 6100):
        w.run(step * 0.01)
        peak = max(peak, w.pinned_blocks()[0])
    assert all(l.outcome is Outcome.RELEASED for l in w.leases.values()) and len(w.leases) == requests
    assert max(l.end_true - l.granted_true for l in w.leases.values()) < 0.5
    assert peak <= 4 * n * rate_per_s  # at most ~1 s worth of requests pinned
    assert_invariants(w)


# -- K07 heterogeneous tensor parallelism --------------------------------------------------------
@pytest.mark.parametrize("p_tp, d_tp", [(4, 2), (8, 2), (2, 1), (4, 4)])
def test_k07_every_p_rank_frees_in_the_same_step(p_tp, d_tp):
    w = World(WorldConfig(p_tp=p_tp, d_tp=d_tp, latency_s=0.001, max_running=1))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.01, d_local_id="d-local-R"))
    w.add(RequestSpec("Q", prefill_end_s=0.0, route_delay_s=0.02, d_local_id="d-local-Q"))
    w.run(60)
    for req in ("R", "Q"):
        ends = {w.lease(req, rank).end_local for rank in range(p_tp)}
        assert len(ends) == 1 and all(w.lease(req, r).outcome is Outcome.RELEASED for r in range(p_tp))
    assert w.pinned_blocks() == [0] * p_tp
    assert_invariants(w)


@pytest.mark.parametrize("L, kill", [(30, 5.0), (12, 2.0)])
def test_k07_p_waits_for_two_completions_and_one_is_lost(L, kill):
    # D TP=4 on P TP=2: each P rank waits for 2 completions; D rank 1's never arrives
    w = World(WorldConfig(lease_duration_s=L, p_tp=2, d_tp=4, latency_s=0.001))
    w.bus.rules.append(lambda msg, rng: __import__("leasekit.sim.bus", fromlist=["Action"]).Action(drop=True)
                       if msg.kind == "completion" and msg.src.endswith("-r1") else None)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.kill_d(kill)
    w.run(3 * L)
    assert w.lease("R", 1).outcome is Outcome.RELEASED  # ranks 2 and 3 reported
    lost = w.lease("R", 0)
    assert lost.outcome is Outcome.EXPIRED  # bounded: never a wait forever
    assert lost.end_local <= max(L, max(lost.hb_processed_local, default=0) + LeaseTiming.from_lease_duration(L).extension_s) + 0.1 + 1e-9
    assert_invariants(w)


# -- K08 the loss budget -------------------------------------------------------------------------
def waiting_lease_with_dropped_heartbeats(L: int, dropped: int, latency: float = 0.0) -> World:
    t = LeaseTiming.from_lease_duration(L)
    first_drop = 1 + 5 * t.heartbeat_interval_s  # heartbeats at 1, 1+H, ...; drop from the 6th on
    drops = {round(first_drop + i * t.heartbeat_interval_s, 9) for i in range(dropped)}
    w = World(WorldConfig(lease_duration_s=L, latency_s=latency, max_running=0))
    w.bus.rules.append(drop_heartbeats(lambda m: round(m.sent_at_s, 9) in drops))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.0))
    w.run(2 * L + 30)
    return w


@pytest.mark.parametrize("L", [30, 60, 12])
def test_k08_losses_within_the_budget_are_survived(L):
    from leasekit.lease import loss_budget

    budget = loss_budget(LeaseTiming.from_lease_duration(L))
    for dropped in range(budget + 1):
        w = waiting_lease_with_dropped_heartbeats(L, dropped, latency=0.003)
        assert "R" in w.tables[0], f"{dropped} lost heartbeats expired a lease (budget {budget})"
        assert_invariants(w, quiescent=False)


@pytest.mark.parametrize("L", [30, 60, 12])
def test_k08_the_tie_is_pinned_drain_before_reap_saves_the_lease(L):
    from leasekit.lease import loss_budget

    timing = LeaseTiming.from_lease_duration(L)
    # budget + 1 lost: the next heartbeat is sent exactly at the expiry instant (latency 0)
    w = waiting_lease_with_dropped_heartbeats(L, loss_budget(timing) + 1, latency=0.0)
    lease = w.lease("R")
    gap = [b - a for a, b in zip(lease.hb_processed_local, lease.hb_processed_local[1:])]
    assert max(gap) == timing.extension_s  # it arrived exactly on the deadline...
    assert "R" in w.tables[0]  # ...and was drained before the reap: the lease lives (pinned rule)
    # and the reap rule itself is not strict: a lease with no heartbeat dies at its deadline instant
    table = PLeaseTable(timing)
    table.grant("X", 0.0)
    assert [e.req_id for e in table.reap(float(L))] == ["X"]


@pytest.mark.parametrize("L", [30, 60])
def test_k08_one_more_loss_expires_and_the_later_read_is_detected(L):
    from leasekit.lease import loss_budget

    timing = LeaseTiming.from_lease_duration(L)
    w = waiting_lease_with_dropped_heartbeats(L, loss_budget(timing) + 2, latency=0.0)
    lease = w.lease("R")
    assert lease.outcome is Outcome.EXPIRED
    assert lease.end_local == lease.hb_processed_local[-1] + timing.extension_s
    # D admits it 4 s after the reclaim: the read must be detected, never served
    late = World(WorldConfig(lease_duration_s=L, latency_s=0.0, max_running=0))
    late.bus.rules = list(w.bus.rules)
    late.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.0))
    late.at(lease.end_true + 4.0, lambda world: setattr(world.config, "max_running", 1))
    late.run(2 * L + 30)
    assert late.requests["R"].d_outcome == "stale_detected"
    assert late.tables[0].counters["late_completions"] == 1
    assert_invariants(late)


# -- K09 drain before reap; delayed notifications ------------------------------------------------
@pytest.mark.parametrize("queued_at, p_resumes", [(29.9, 30.5), (29.5, 31.0), (29.99, 30.01)])
def test_k09_a_queued_heartbeat_is_drained_before_the_reap(queued_at, p_resumes):
    w = World(WorldConfig(latency_s=0.0, max_running=0))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=queued_at))
    w.stall_p(queued_at - 0.05, p_resumes - (queued_at - 0.05))
    w.run(p_resumes + 0.05)
    lease = w.tables[0].get("R")
    assert lease is not None and lease.deadline_s == pytest.approx(p_resumes + 20)
    assert_invariants(w, quiescent=False)


@pytest.mark.parametrize("sent, delivered, reap", [(24.0, 30.4, 30.2), (20.0, 35.0, 30.0)])
def test_k09_a_heartbeat_delivered_after_the_reap_revives_nothing(sent, delivered, reap):
    w = World(WorldConfig(latency_s=0.0, max_running=0))
    w.bus.rules.append(delay_when(lambda m: m.kind == "heartbeat", delivered - sent))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=sent))
    w.stall_p(29.95, reap - 29.95) if reap > 30.0 else None
    w.at(45.0, lambda world: setattr(world.config, "max_running", 1))
    w.run(80)
    lease = w.lease("R")
    assert lease.outcome is Outcome.EXPIRED and lease.end_local == pytest.approx(reap)
    assert w.counters["unknown_heartbeat_ids"] >= 1  # the late heartbeat is counted, not applied
    assert w.requests["R"].d_outcome == "stale_detected"  # the late read is detected
    assert_invariants(w)


# -- K10 D restarts on the same host:port --------------------------------------------------------
@pytest.mark.parametrize("kill, restart", [(10.0, 60.0), (3.0, 35.0)])
def test_k10_restart_reclaims_the_old_leases_and_revives_nothing(kill, restart):
    w = World(WorldConfig(latency_s=0.001, max_running=0))
    for i in range(5):
        w.add(RequestSpec(f"R{i}", prefill_end_s=0.0, route_delay_s=0.5))
    # a heartbeat D1 sent just before dying is delivered after the restart
    w.bus.rules.append(delay_when(lambda m: m.kind == "heartbeat" and kill - 5.0 <= m.sent_at_s < kill, restart + 5 - kill))
    w.kill_d(kill)
    w.restart_d(restart)
    w.at(restart + 1, lambda world: setattr(world.config, "max_running", 8))
    w.add(RequestSpec("AFTER", prefill_end_s=restart + 2, route_delay_s=0.01))
    w.run(restart + 30)
    for i in range(5):
        lease = w.lease(f"R{i}")
        assert lease.outcome is Outcome.EXPIRED and lease.end_true <= 30.0 + 0.1 + 1e-9
    assert w.counters["unknown_heartbeat_ids"] >= 5  # the late heartbeat named R0-R4 and revived nothing
    assert not any(f"R{i}" in w.tables[0] for i in range(5))
    assert w.requests["AFTER"].d_outcome == "served"
    assert_invariants(w)


# -- K11 P dies during D's handshake -------------------------------------------------------------
@pytest.mark.parametrize("handshake_s, retries, p_dies", [(1.0, 3, 0.5), (0.2, 5, 0.1)])
def test_k11_p_dies_during_the_handshake_and_the_request_fails_in_bounded_time(handshake_s, retries, p_dies):
    w = World(WorldConfig(latency_s=0.001, d_handshaken=False, handshake_s=handshake_s, handshake_retries=retries))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.0))
    w.kill_p(p_dies)
    w.run(60)
    record = w.requests["R"]
    assert record.d_outcome == "failed"  # recompute or error per kv_load_failure_policy
    assert record.d_outcome_true <= (retries + 1) * (handshake_s + w.config.d_tick_s)
    assert w.counters["handshake_failures"] == retries
    assert w.d_alive


# -- K12 counters that mean one thing ------------------------------------------------------------
@pytest.mark.parametrize("L, p_tp", [(30, 8), (60, 8), (30, 2), (12, 4)])
def test_k12_each_counter_has_its_declared_value(L, p_tp):
    w = World(WorldConfig(lease_duration_s=L, p_tp=p_tp, d_tp=p_tp, latency_s=0.001, max_running=0))
    for i in range(3):
        w.add(RequestSpec(f"OK{i}", prefill_end_s=0.0, route_delay_s=0.1))
    for i in range(2):
        w.add(RequestSpec(f"EXP{i}", prefill_end_s=0.0, route_delay_s=None))
    w.add(RequestSpec("LATE", prefill_end_s=0.0, route_delay_s=None))
    w.add(RequestSpec("XFER", prefill_end_s=0.0, route_delay_s=0.1, read_fails=True))
    # D heartbeats OK0-2 and XFER from t=0.1; exactly 4 batches reach P; the 5th batch fails to send
    # on every D rank, and right after it D admits everything queued.
    batch_times: list[float] = []

    def fifth_batch(m):
        if m.kind != "heartbeat":
            return False
        if m.sent_at_s not in batch_times:
            batch_times.append(m.sent_at_s)
            if len(batch_times) == 5:
                w.at(m.sent_at_s + 0.05, lambda world: setattr(world.config, "max_running", 100))
        return len(batch_times) == 5 and m.sent_at_s == batch_times[4]

    w.bus.rules.append(fail_sends(fifth_batch))
    w.at(1.5 * L, lambda world: world._route_at(world.requests["LATE"], world.now))  # read after its expiry
    w.run(4 * L)
    per_rank = {k: sum(t.counters[k] for t in w.tables) for k in ("granted", "released", "expired", "late_completions", "extended")}
    assert per_rank["granted"] == 7 * p_tp
    assert per_rank["released"] == 3 * p_tp  # OK0-2
    assert per_rank["expired"] == 4 * p_tp  # EXP0-1, LATE, and XFER (P never heard back)
    assert per_rank["late_completions"] == 1 * p_tp  # LATE's read, once per P rank
    assert per_rank["extended"] == 4 * 4 * p_tp  # 4 batches x 4 waiting requests x P ranks
    assert w.counters["transport_failures"] == 1  # per request, and never an expiry
    # per batch (D engine): 4 delivered, the failed 5th, and LATE's own batch after its expiry
    assert w.counters["heartbeat_batches"] == 6
    assert w.counters["heartbeat_send_failures"] == p_tp  # per D rank send: one failed batch
    assert w.counters["unknown_heartbeat_ids"] == p_tp  # LATE's batch named an ended lease: per rank
    assert w.counters["stale_reads_detected"] == 1  # LATE
    assert sum(r.d_outcome == "served" for r in w.requests.values()) == 3


# -- K13 a fault matrix of crafted kv_transfer_params --------------------------------------------
@pytest.mark.parametrize("L", [30, 12])
@pytest.mark.parametrize("row", ["unknown_id", "bad_blocks", "consumed", "reused", "expired"])
def test_k13_every_crafted_read_is_detected_and_counted(row, L):
    w = World(WorldConfig(lease_duration_s=L, latency_s=0.001, max_running=1 << 10))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.01 if row in ("consumed", "reused") else None))
    if row == "reused":
        w.add(RequestSpec("OTHER", prefill_end_s=2.0, route_delay_s=None))  # takes R's freed blocks
    spec = {
        "unknown_id": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=0.01, remote_of="no-such-request"),
        "bad_blocks": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=0.01, remote_of="R", bad_blocks=True),
        "consumed": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=0.01, remote_of="R"),
        "reused": RequestSpec("X", prefill_end_s=3.0, blocks=0, route_delay_s=0.01, remote_of="R"),
        "expired": RequestSpec("X", prefill_end_s=1.0, blocks=0, route_delay_s=1.5 * L - 1.0, remote_of="R"),  # read at 1.5 L
    }[row]
    w.add(spec)
    w.run(3 * L)
    x = w.requests["X"]
    assert x.d_outcome == "stale_detected"
    assert x.read_result == {"unknown_id": "invalid", "bad_blocks": "invalid", "consumed": "freed",
                             "reused": "reused", "expired": "freed"}[row]
    assert w.counters["stale_reads_detected"] == 1
    assert inv.fail_closed(w) == []
