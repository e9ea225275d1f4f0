"""PLeaseTable, DHeartbeatTracker and the TP topology helpers, unit by unit."""

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.codec import Completion, DecodeError, Heartbeat
from leasekit.lease.table import LeaseEnd, Outcome, PLeaseTable
from leasekit.lease.topology import consumers_per_prefill_rank, decode_ranks_for, prefill_ranks_for
from leasekit.lease.tracker import DHeartbeatTracker

T30 = LeaseTiming.from_lease_duration(30)


def test_renew_takes_the_max_and_counts_unknown_ids():
    table = PLeaseTable(T30)
    table.grant("R", 0.0)
    assert table.heartbeat(["R", "ghost"], 2.0) == ["ghost"]
    assert table.get("R").deadline_s == 30.0  # 2 + 20 < 30: never shorter
    table.heartbeat(["R"], 15.0)
    assert table.get("R").deadline_s == 35.0 and table.get("R").extend_count == 2
    assert table.counters["unknown_heartbeat_ids"] == 1 and table.counters["extended"] == 2


def test_reap_order_and_next_deadline():
    table = PLeaseTable(T30)
    table.grant("A", 5.0)   # 35
    table.grant("B", 1.0)   # 31
    table.grant("C", 2.0)   # 32
    table.heartbeat(["B"], 20.0)  # B -> 40
    assert table.next_deadline() == 32.0
    assert [e.req_id for e in table.reap(35.0)] == ["C", "A"]
    assert table.next_deadline() == 40.0
    assert table.reap(39.999) == []
    assert [e.req_id for e in table.reap(40.0)] == ["B"]
    assert table.next_deadline() is None and len(table) == 0


def test_completions_count_distinct_senders_and_release_at_n():
    table = PLeaseTable(T30)
    table.grant("R", 0.0)
    assert table.completion("R", 2, 1.0, sender="d0").kind == "counted"
    assert table.completion("R", 2, 1.1, sender="d0").kind == "duplicate"
    result = table.completion("R", 2, 1.2, sender="d1")
    assert result.kind == "released" and result.end.outcome is Outcome.RELEASED
    assert table.completion("R", 2, 1.3, sender="d2").kind == "late"
    assert table.counters["late_completions"] == 1 and table.counters["duplicate_completions"] == 1
    assert table.completion("R", 0, 1.4).kind == "invalid"


def test_buffered_completions_expire_after_L_and_are_capped():
    table = PLeaseTable(T30, max_buffered=2)
    for i in range(3):
        assert table.completion(f"X{i}", 1, 0.0, sender="d").kind == "buffered"
    assert table.counters["buffer_dropped"] == 1  # the oldest, X0
    assert isinstance(table.grant("X0", 1.0), type(table.get("X0")))  # not matched: it was dropped
    table.reap(30.5)  # buffered X1, X2 are older than L: dropped
    assert table.counters["buffer_dropped"] == 3
    assert not isinstance(table.grant("X1", 31.0), LeaseEnd)


def test_step_drains_before_reaping_and_collects_errors():
    table = PLeaseTable(T30)
    table.grant("R", 0.0)
    bad = DecodeError("no_colon", "abc")
    result = table.step(30.0, [("d0", Heartbeat(("R",))), ("d0", bad), ("d0", Completion("gone", 1))])
    assert result.ended == [] and table.get("R").deadline_s == 50.0
    assert result.errors == [bad] and table.counters["decode_errors"] == 1
    assert table.counters["buffered_completions"] == 1


def test_abort_and_release_are_idempotent_and_grant_of_a_live_id_is_a_no_op():
    table = PLeaseTable(T30)
    lease = table.grant("R", 0.0)
    assert table.grant("R", 5.0) is lease
    assert table.abort("R", 1.0).outcome is Outcome.ABORTED
    assert table.abort("R", 1.0) is None and table.release("R", 1.0) is None
    assert table.ended_outcome("R") is Outcome.ABORTED


def test_renewals_leave_one_heap_entry_per_lease():
    table = PLeaseTable(T30)
    for i in range(100):
        table.grant(f"R{i}", 0.0)
    for k in range(1, 200):
        table.heartbeat([f"R{i}" for i in range(100)], float(k))  # each pushes a new entry
    assert len(table._heap) == len(table)  # one entry per lease: renewals push nothing
    assert table.next_deadline() == 199.0 + 20


def test_tracker_batches_once_per_interval_per_engine_and_stops():
    tracker = DHeartbeatTracker(T30)
    assert tracker.due(0.0) == {}  # nothing tracked: no batch, timer not advanced
    tracker.on_enqueue("d1", "P0", "p1")
    tracker.on_enqueue("d2", "P1", "p2")
    tracker.on_enqueue("d3", "P0", "p3")
    assert not tracker.on_enqueue("d4", None, "p4")
    assert tracker.due(1.0) == {"P0": ("p1", "p3"), "P1": ("p2",)}
    assert tracker.due(5.9) == {}
    tracker.stop("d2")
    assert tracker.stop("d2") is False
    assert tracker.due(6.0) == {"P0": ("p1", "p3")}
    assert tracker.engines() == ["P0"]


def test_tracker_replays_vllms_timer_start():
    tracker = DHeartbeatTracker(T30, last_batch_s=0.0)
    tracker.on_enqueue("d1", "P0", "p1")
    assert tracker.due(4.0) == {}  # vLLM: 4.0 - 0.0 < H
    assert tracker.due(5.0) == {"P0": ("p1",)}


@pytest.mark.parametrize("d_tp, p_tp, expect", [
    (1, 1, {0: (0,)}), (2, 4, {0: (0, 1), 1: (2, 3)}), (4, 2, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}), (1, 8, {0: tuple(range(8))}),
])
def test_topology_covers_every_p_rank(d_tp, p_tp, expect):
    assert {d: prefill_ranks_for(d, d_tp, p_tp) for d in range(d_tp)} == expect
    assert set().union(*expect.values()) == set(range(p_tp))  # every P rank hears from some D rank
    for p in range(p_tp):
        assert len(decode_ranks_for(p, d_tp, p_tp)) == consumers_per_prefill_rank(d_tp, p_tp)


@pytest.mark.parametrize("d_tp, p_tp", [(3, 2), (0, 1), (2, True)])
def test_topology_refuses_bad_sizes(d_tp, p_tp):
    with pytest.raises(ValueError, match="tp"):
        prefill_ranks_for(0, d_tp, p_tp)


def test_vllm_stamped_deadline_max_hold_cap_and_restamp():
    table = PLeaseTable(T30, max_hold_s=40.0)
    lease = table.grant("R", 100.0, deadline_s=130.0)  # granted at 100 (deadline - L): cap 140
    assert (lease.granted_at_s, lease.deadline_s) == (100.0, 130.0)
    assert table.renew("R", 115.0) == 135.0
    assert table.renew("R", 125.0) == 140.0  # 145 capped at grant + max hold
    assert table.renew("R", 139.0) == 140.0 and table.renew("ghost", 1.0) is None
    assert table.set_deadline("R", 120.0)  # vLLM re-stamped it shorter: the heap must follow
    assert [e.req_id for e in table.reap(120.0)] == ["R"]
    assert table.discard("R") is False and len(table) == 0


def test_expiring_within_counts_live_deadlines_under_the_horizon_only():
    table = PLeaseTable(T30)
    for i in range(50):
        table.grant(f"R{i}", float(i))  # deadlines 30 .. 79
    for i in range(0, 50, 2):
        table.renew(f"R{i}", 55.0)  # even ids -> max(deadline, 75)
    table.discard("R1")
    table.release("R3", 1.0)
    horizon = 65.0  # now 60 + 5: odd ids with deadline < 65, i.e. R5..R33 odd
    expect = sum(1 for lease in table.leases() if lease.deadline_s < 60.0 + 5.0)
    assert expect == len([i for i in range(5, 35, 2)])
    assert table.expiring_within(5.0, 60.0) == expect
    assert table.expiring_within(5.0, 60.0) == expect  # idempotent after the refresh
    assert table.expiring_within(100.0, 60.0) == 48 and table.expiring_within(0.0, 0.0) == 0
    assert horizon == 65.0
