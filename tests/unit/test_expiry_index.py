"""ExpiryIndex: P's expiry heap kept in step with vLLM's ``_reqs_to_send`` (the source of truth)."""

from leasekit.lease import LeaseTiming
from leasekit.lease.pkeeping import PLeaseKeeping
from leasekit.vllm.prefill.expiry import AUDIT_INTERVAL_S, ExpiryIndex

T6 = LeaseTiming.from_lease_duration(6)


def test_due_follows_the_dict_not_the_heap():
    stamped = {"A": 106.0, "B": 107.0, "C": 108.0}
    index = ExpiryIndex(stamped, PLeaseKeeping(T6, max_hold_s=480.0).table)
    index.index(["A", "B", "C", "ghost"], 100.0)  # an id vLLM does not hold is skipped
    assert len(index) == 3 and index.get("ghost") is None
    stamped["A"] = 110.0  # moved behind the heap's back (no renew): due() re-indexes it, not reaps it
    assert index.due(106.0) == {}
    assert index.renew("B", 104.0, 4.0) == 108.0  # max(107, 104 + 4)
    stamped["B"] = 108.0
    assert index.due(108.0) == {"B": 108.0, "C": 108.0}
    del stamped["B"], stamped["C"]  # the reaper frees them
    assert len(index) == 1 and index.due(109.999) == {} and index.due(110.0) == {"A": 110.0}


def test_size_mismatch_and_the_periodic_audit_rebuild_the_index():
    stamped = {"A": 106.0}
    index = ExpiryIndex(stamped, PLeaseKeeping(T6, max_hold_s=480.0).table)
    index.index(["A"], 100.0)
    stamped["X"] = 103.0  # added by a path the worker does not hook: sizes differ
    assert index.due(103.0) == {"X": 103.0}
    del stamped["X"]
    assert index.due(104.0) == {}  # audit done; A (106) unchanged
    stamped["A"] = 105.0  # shortened behind its back, sizes equal: caught by the next audit
    assert index.due(105.0) == {}
    assert index.due(100.0 + AUDIT_INTERVAL_S + 5.0) == {"A": 105.0}


def test_renew_is_capped_by_max_hold_and_discard_forgets():
    stamped = {"A": 106.0}
    index = ExpiryIndex(stamped, PLeaseKeeping(T6, max_hold_s=8.0).table)  # granted at 100: cap 108
    index.index(["A"], 100.0)
    assert index.renew("A", 105.0, 4.0) == 108.0 and index.renew("ghost", 105.0, 4.0) is None
    assert index.expiring_within(1.0, 107.5) == 1 and index.expiring_within(1.0, 106.0) == 0
    index.discard("A")
    del stamped["A"]
    assert len(index) == 0 and index.due(1e9) == {}


def test_a_held_lease_is_not_reaped_this_step_and_is_the_next():
    from leasekit.lease.config import LeaseTiming
    from leasekit.lease.table import PLeaseTable
    from leasekit.vllm.prefill.expiry import ExpiryIndex

    class State:
        def __init__(self, stamped):
            self.reqs_to_send = stamped

        def rebind_reqs_to_send(self, mapping):
            self.current = mapping

    stamped = {"a": 10.0, "b": 10.0}
    state = State(stamped)
    index = ExpiryIndex(stamped, PLeaseTable(LeaseTiming.from_lease_duration(6)))
    index.index(stamped, 4.0)

    def vllm_reap(done):  # vLLM's reap of the narrowed map
        for req_id in list(state.current):
            del state.current[req_id]
            done.add(req_id)

    done: set[str] = set()
    assert index.reap(state, done, vllm_reap, 11.0, hold=("b",)) == ["a"]
    assert "b" in stamped and "a" not in stamped and len(index) == 1
    assert index.reap(state, done, vllm_reap, 11.1) == ["b"] and stamped == {}
