"""Incident classes K01-K03, K08-K10 in virtual time, over families of timings: when a lease must expire, when not."""

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.table import Outcome, PLeaseTable
from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim import invariants as inv
from leasekit.sim.bus import delay_when, drop_heartbeats
from tests.sim.cases_helpers import assert_invariants


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
