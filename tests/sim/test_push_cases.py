"""Push-mode timelines in virtual time (``transfer_mode="push"``, leasekit/sim/push.py), each over a family of
timings: registration and WRITE, release by the WRITE only, expiry with a WRITE in flight, D killed before it
registers, repeats, registrations after the expiry, D giving up with a WRITE in flight.

Every world also passes the always-true push invariants (``push_invariants.ALWAYS``) and, once quiet,
conservation; where a healthy-run invariant is broken the test asserts exactly which one.
"""

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.pkeeping import PLeaseKeeping
from leasekit.lease.table import Outcome
from leasekit.lease.topology import prefill_ranks_for
from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim import push_invariants as pinv
from leasekit.sim.bus import drop_heartbeats


def push_world(L=30, **kwargs) -> World:
    return World(WorldConfig(transfer_mode="push", lease_duration_s=L, latency_s=kwargs.pop("latency_s", 0.001), **kwargs))


def first_step_at_or_after(world: World, t_local: float) -> float:
    return min(s for s in world.p_steps_local if s >= t_local - 1e-9)


def assert_always(world: World, quiescent: bool = True) -> None:
    assert pinv.check_push(world, quiescent=quiescent) == {}


# -- registration, WRITE, release ------------------------------------------------------------------
@pytest.mark.parametrize("L", [6, 12, 30])
@pytest.mark.parametrize("write_s", [0.01, 2.0, "2L"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_registration_at_admission_then_one_write_per_p_rank_releases_each_lease(L, write_s, p_tp, d_tp):
    write_s = 2.0 * L if write_s == "2L" else write_s
    w = push_world(L, write_s=write_s, p_tp=p_tp, d_tp=d_tp)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.run(write_s + 3 * L)
    record, records = w.requests["R"], w.push.records
    assert record.registered_true == record.admitted_true is not None  # D registers when it allocates
    pairs = {(d, p) for d in range(d_tp) for p in prefill_ranks_for(d, d_tp, p_tp)}
    assert {(d, p) for _, req, d, p in records.regs_sent if req == "R"} == pairs and len(records.regs_sent) == len(pairs)
    accepted = [(rank, req) for _, rank, req, decision in records.reg_arrivals if decision == "accepted"]
    assert sorted(accepted) == [(rank, "R") for rank in range(p_tp)]  # the first per P rank...
    assert records.reg_drops == {"push_reg_repeat": len(pairs) - p_tp} if len(pairs) > p_tp else not records.reg_drops
    assert sorted(x.rank for x in records.writes) == list(range(p_tp))  # ...makes the only WRITE
    for write in records.writes:
        assert write.issued_true == pytest.approx(record.registered_true + 0.001)  # at the registration's arrival
        assert write.done_true == pytest.approx(write.issued_true + write_s)
        assert (write.outcome, write.source, write.dest, write.p_view) == ("landed", "ok", "ok", "released")
        lease = w.lease("R", write.rank)
        assert lease.outcome is Outcome.RELEASED and lease.end_local == first_step_at_or_after(w, write.done_true)
    assert record.landed_true == max(x.done_true for x in records.writes)
    assert record.d_outcome == "served"
    if write_s >= L:  # D heartbeated the lease all through the WRITE: it never came near its end
        assert max(w.lease("R").hb_processed_local) > L
    assert w.pinned_blocks() == [0] * p_tp and w.push_d.pool(0).pinned == 0
    assert pinv.check_push(w, quiescent=True, healthy=True) == {}


def test_lease_keeping_as_lk_worker_runs_it_is_released_by_the_write_too():
    w = World(WorldConfig(transfer_mode="push", latency_s=0.001, write_s=1.0),
              table_factory=lambda timing: PLeaseKeeping(timing, max_hold_s=480.0))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.run(60)
    assert w.lease("R").outcome is Outcome.RELEASED and len(w.tables[0].leases()) == 0
    assert pinv.check_push(w, quiescent=True, healthy=True) == {}


# -- a read completion never releases a push lease ---------------------------------------------------
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 2), (1, 2)])
def test_a_read_completion_is_dropped_and_only_the_write_releases(p_tp, d_tp):
    w = push_world(30, write_s=5.0, p_tp=p_tp, d_tp=d_tp)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5, stray_completion=True))
    w.run(3.0)
    assert all("R" in table for table in w.tables)  # the completion reached every P rank and released nothing
    assert w.push.records.counters["completions_dropped"] == max(p_tp, d_tp)
    w.run(60)
    for rank in range(p_tp):
        lease, write = w.lease("R", rank), next(x for x in w.push.records.writes if x.rank == rank)
        assert lease.outcome is Outcome.RELEASED and lease.end_local == first_step_at_or_after(w, write.done_true)
    assert pinv.check_push(w, quiescent=True, healthy=True) == {}


# -- expiry while the WRITE is in flight: a late write -------------------------------------------------
@pytest.mark.parametrize("L", [6, 12, 30])
@pytest.mark.parametrize("silence", ["d_stall", "heartbeats_lost"])
def test_expiry_with_the_write_in_flight_is_a_late_write_from_reused_blocks(L, silence):
    E = LeaseTiming.from_lease_duration(L).extension_s
    w = push_world(L, latency_s=0.0, write_s=2.0 * L)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.add(RequestSpec("NEXT", prefill_end_s=L + 2.0, route_delay_s=None))  # takes R's freed P blocks
    if silence == "d_stall":
        w.stall_d(0.55, 3.0 * L)  # D registered at 0.5, then takes no step (the WRITE still lands in its memory)
    else:
        w.bus.rules.append(drop_heartbeats(lambda m: m.sent_at_s > 0.5))
    w.run(6 * L)
    lease, (write,) = w.lease("R"), w.push.records.writes
    assert lease.hb_processed_local == [0.5]
    assert lease.outcome is Outcome.EXPIRED
    assert lease.end_local == first_step_at_or_after(w, max(L, 0.5 + E))  # reclaimed in the bound, WRITE or not
    assert write.issued_true == 0.5 and write.done_true == pytest.approx(0.5 + 2.0 * L)
    assert w.push.records.late_writes == [write] and write.p_view == "late"
    assert write.source == "reused" and write.dest == "ok"  # D received NEXT's KV
    assert w.requests["R"].d_outcome == "served"  # D cannot tell...
    assert_always(w)  # ...every always-true invariant holds, and the healthy-run ones flag exactly this:
    found = pinv.check_push(w, healthy=True)
    assert set(found) == {"no_late_writes", "push_data_intact"} and "R" in found["push_data_intact"][0]


@pytest.mark.parametrize("L, stall", [(30, 40.0), (12, 20.0)])
def test_a_long_p_stall_after_the_write_makes_a_late_write_with_intact_blocks(L, stall):
    # P's last step before its stall is at 2.4; the WRITE finishes at 2.5 and D stops heartbeating; P resumes past
    # the last heartbeat + E: its first step reaps the lease, then sees the WRITE done (vLLM's order): a late
    # write, though the blocks were read intact.
    w = push_world(L, latency_s=0.0, write_s=2.0)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.stall_p(2.45, stall)
    w.run(4 * L + stall)
    lease, (write,) = w.lease("R"), w.push.records.writes
    assert lease.outcome is Outcome.EXPIRED and lease.end_local == pytest.approx(2.45 + stall)
    assert w.push.records.late_writes == [write] and write.source == "ok"
    assert w.requests["R"].d_outcome == "served"
    assert_always(w)
    assert set(pinv.check_push(w, healthy=True)) == {"no_late_writes"}  # the data is intact


# -- D killed: reclaim in the bound -----------------------------------------------------------------------
@pytest.mark.parametrize("L", [6, 12, 30])
@pytest.mark.parametrize("kill_after_heartbeats", [1, 3])
def test_d_killed_before_registering_is_reclaimed_in_the_bound(L, kill_after_heartbeats):
    t = LeaseTiming.from_lease_duration(L)
    H, E = t.heartbeat_interval_s, t.extension_s
    kill = 1 + (kill_after_heartbeats - 1) * H + H / 5
    w = push_world(L, max_running=0)  # D queues the request and never admits it: no registration
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.0))
    w.kill_d(kill)
    w.run(3 * L + 10)
    lease = w.lease("R")
    assert len(lease.hb_processed_local) == kill_after_heartbeats
    assert lease.outcome is Outcome.EXPIRED
    assert lease.end_local == first_step_at_or_after(w, max(L, lease.hb_processed_local[-1] + E))
    assert not w.push.records.regs_sent and not w.push.records.writes
    assert w.requests["R"].d_outcome == "lost"
    assert_always(w)


@pytest.mark.parametrize("L", [6, 30])
def test_d_killed_with_the_write_in_flight_the_write_fails_and_the_lease_expires_in_the_bound(L):
    E = LeaseTiming.from_lease_duration(L).extension_s
    w = push_world(L, latency_s=0.0, write_s=L / 2)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.kill_d(1.0)
    w.run(3 * L)
    lease, (write,) = w.lease("R"), w.push.records.writes
    assert (write.outcome, write.p_view) == ("failed", "failed")  # NIXL error: P does not release
    assert lease.outcome is Outcome.EXPIRED
    assert lease.end_local == first_step_at_or_after(w, max(L, lease.hb_processed_local[-1] + E))
    assert not w.push.records.late_writes
    assert_always(w)


# -- registrations P must not act on ------------------------------------------------------------------------
def test_a_duplicated_registration_is_a_repeat_and_makes_no_second_write():
    from leasekit.sim.bus import duplicate_when

    w = push_world(30, write_s=1.0)
    w.bus.rules.append(duplicate_when(lambda m: m.kind == "push_reg", copies=3))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.run(60)
    assert w.push.records.reg_drops == {"push_reg_repeat": 2} and len(w.push.records.writes) == 1
    assert pinv.check_push(w, quiescent=True, healthy=True) == {}


@pytest.mark.parametrize("L", [6, 30])
def test_a_registration_after_the_expiry_is_dropped_and_d_gives_up_at_its_timeout(L):
    w = push_world(L, push_timeout_s=2.0 * L)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=1.5 * L))  # reaches D after its lease ended
    w.run(5 * L)
    record, records = w.requests["R"], w.push.records
    assert w.lease("R").outcome is Outcome.EXPIRED and w.lease("R").end_local == first_step_at_or_after(w, L)
    assert [d for _, _, _, d in records.reg_arrivals] == ["held"]  # waits max(H, 2 s) for a lease...
    assert records.reg_drops == {"push_reg_unknown_id": 1} and not records.writes  # ...then dropped, no WRITE
    assert record.d_outcome == "timed_out"
    assert record.d_outcome_true == pytest.approx(record.registered_true + 2.0 * L, abs=0.11)
    assert w.push_d.pool(0).pinned == 0
    assert pinv.check_push(w, quiescent=True, healthy=True) == {}


# -- D gives up with the WRITE in flight: a WRITE into a reused D slot --------------------------------------------
@pytest.mark.parametrize("abort_at, write_s", [(2.0, 5.0), (1.0, 10.0)])
def test_d_aborting_with_the_write_in_flight_gets_the_write_in_a_reused_slot(abort_at, write_s):
    w = push_world(30, write_s=write_s)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5, d_abort_at_s=abort_at))
    # D gives OTHER R's freed blocks; OTHER's own WRITE lands after R's
    w.add(RequestSpec("OTHER", prefill_end_s=abort_at + 0.5, route_delay_s=0.5))
    w.run(3 * 30 + write_s)
    r, other, records = w.requests["R"], w.requests["OTHER"], w.push.records
    assert r.d_outcome == "aborted" and r.d_outcome_true == pytest.approx(abort_at)
    write = next(x for x in records.writes if x.req_id == "R")
    assert write.dest == "reused" and records.reused_d_writes == [write]
    assert records.counters["d_late_writes"] == 1
    assert w.lease("R").outcome is Outcome.RELEASED  # P cannot tell: its WRITE completed
    assert other.d_outcome == "served"
    assert_always(w)
    assert set(pinv.check_push(w, healthy=True)) == {"no_reused_d_writes"}


# -- the modes stay apart -------------------------------------------------------------------------------------------
def test_pull_mode_refuses_push_fields_and_an_unknown_mode_is_refused():
    w = World(WorldConfig())
    assert w.push is None and w.push_d is None
    for spec in (RequestSpec("A", 0.0, d_abort_at_s=1.0), RequestSpec("B", 0.0, write_s=1.0),
                 RequestSpec("C", 0.0, stray_completion=True)):
        with pytest.raises(ValueError, match="transfer_mode='push'"):
            w.add(spec)
    with pytest.raises(ValueError, match="transfer_mode"):
        World(WorldConfig(transfer_mode="pushy"))
    with pytest.raises(ValueError, match="push"):
        pinv.check_push(w)
