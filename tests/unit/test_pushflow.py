"""The push worker's flow between vLLM's writer thread and the engine thread (leasekit/vllm/pushflow.py): what
the writer sees of a NIXL batch, what the engine thread gets (with senders), base-id matching of registrations to
P's leases, and the drops and WRITEs recorded on the engine thread. Pure: a dict stands in for ``_reqs_to_send``."""

from __future__ import annotations

import msgspec

from leasekit.lease.pushreg import PUSH_REG_PREFIX
from leasekit.vllm.pushflow import PushFlow, base_request_id


def reg(request_id: str, host: str = "10.0.0.2") -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode({
        "request_id": request_id, "decode_engine_id": "d-engine", "decode_host": host, "decode_port": 5600,
        "decode_tp_size": 1, "local_block_ids": [[4, 5]], "remote_engine_id": "p", "remote_host": "10.0.0.1",
        "remote_port": 5500, "remote_tp_size": 1, "remote_pp_size": 1})


class Recorder:
    def __init__(self):
        self.notes: dict[str, dict] = {}

    def grant_time(self, req_id):
        return 100.0 if req_id in self.notes else None

    def annotate(self, req_id, attributes):
        self.notes.setdefault(req_id, {}).update(attributes)
        return True


class Stats:
    def __init__(self):
        self.writes: list[str] = []

    def push_write(self, outcome):
        self.writes.append(outcome)


def make(clock=lambda: 0.0, allowed=("10.0.0.2",)):
    leases: dict[str, float] = {}
    drops: list[tuple[str, str, str]] = []
    flow = PushFlow(leases, allowed=lambda host: host in allowed, hold_s=1.0, max_bytes=1 << 20,
                    drop=lambda reason, agent, detail: drops.append((reason, agent, detail)), clock=clock)
    return flow, leases, drops


def test_base_request_id_strips_vllms_random_suffix_only():
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0-1a2b3c4") == "cmpl-abc-0-1a2b3c4"  # 7 hex: not vLLM's suffix


def test_the_writer_sees_only_accepted_registrations_and_the_engine_thread_the_rest_with_senders():
    now = [0.0]
    flow, leases, drops = make(clock=lambda: now[0])
    leases["cmpl-x-0-1a2b3c4d"] = 6.0
    flow.granted("cmpl-x-0-1a2b3c4d")
    batch = {"d-agent": [b"HB:cmpl-x-0-1a2b3c4d", reg("cmpl-x-0-99999999"), b"junk"],
             "stranger": [reg("cmpl-x-0-1a2b3c4d"), reg("cmpl-nobody-0"), PUSH_REG_PREFIX + b"\xc1"]}
    writer = flow.writer_batch(batch)
    assert writer == {"d-agent": [reg("cmpl-x-0-99999999")]}  # D's own id, matched by base id; the lease's first
    assert flow.take_notifications() == {"d-agent": [b"HB:cmpl-x-0-1a2b3c4d", b"junk"]}
    assert flow.take_notifications() == {}
    recorder, stats = Recorder(), Stats()
    flow.record(recorder, stats)
    assert [(reason, agent) for reason, agent, _ in drops] == [("bad_push_reg", "stranger"),  # decoded first
                                                                ("push_reg_repeat", "stranger")]
    now[0] = 1.0  # the unknown one waited its hold (H) for a grant that never came
    assert flow.writer_batch({}) == {}
    flow.record(recorder, stats)
    assert drops[-1][:2] == ("push_reg_unknown_id", "stranger")


def test_a_write_issued_is_noted_on_its_lease_with_the_registering_agent():
    now = [103.5]
    flow, leases, _ = make(clock=lambda: now[0])
    leases["r-1a2b3c4d"] = 106.0
    flow.granted("r-1a2b3c4d")
    assert flow.writer_batch({"d-agent": [reg("r-1a2b3c4d")]})
    flow.issued("r-1a2b3c4d", handles=2)
    recorder, stats = Recorder(), Stats()
    recorder.notes["r-1a2b3c4d"] = {}
    flow.record(recorder, stats)
    note = recorder.notes["r-1a2b3c4d"]
    assert note["leasekit.push.write_issued_after_s"] == 3.5
    assert note["leasekit.push.write_issued_monotonic_s"] == 103.5
    assert note["leasekit.push.decode_agent"].startswith("peer-") and "d-agent" not in note["leasekit.push.decode_agent"]
    assert stats.writes == ["issued"]


def test_an_ended_lease_takes_no_more_registrations_and_a_new_one_with_its_id_can():
    flow, leases, drops = make()
    leases["r"] = 6.0
    flow.granted("r")
    assert flow.writer_batch({"a": [reg("r")]})
    del leases["r"]
    flow.ended("r")
    assert flow.live("r") is None and flow.writer_batch({"a": [reg("r")]}) == {}  # held: unknown
    leases["r"] = 12.0  # a new lease for the same id (a retried request)
    flow.granted("r")
    assert flow.writer_batch({}) == {"a": [reg("r")]}


def test_a_registration_for_an_address_p_does_not_allow_never_reaches_the_writer():
    now = [0.0]
    flow, leases, drops = make(clock=lambda: now[0])
    leases["r"] = 6.0
    flow.granted("r")
    assert flow.writer_batch({"stranger": [reg("r", host="127.0.0.2")]}) == {}
    now[0] = 1.0
    assert flow.writer_batch({}) == {}
    flow.record(Recorder(), Stats())
    assert [reason for reason, *_ in drops] == ["push_reg_not_allowed"]
    assert flow.writer_batch({"d": [reg("r")]}) == {"d": [reg("r")]}  # the lease is still free for its real D


def test_the_engine_thread_hears_d_only_up_to_the_start_of_the_writers_last_forwarded_poll():
    flow, leases, _ = make()
    assert flow.heard_until is None and flow.reap_clock(50.0, 4.0) == 50.0  # before the writer's first poll
    flow.writer_batch({"d": [b"HB:a"]}, polled_at=10.0)
    assert flow.heard_until is None  # not taken by the engine thread yet: P has heard nothing
    assert flow.take_notifications() == {"d": [b"HB:a"]}
    assert flow.heard_until == 10.0
    flow.writer_batch({}, polled_at=11.0)  # an empty poll still vouches for the silence before it
    flow.take_notifications()
    assert flow.heard_until == 11.0
    flow.writer_batch({}, polled_at=None)  # a poll of unknown start vouches for nothing new
    flow.take_notifications()
    assert flow.heard_until == 11.0


def test_the_reap_clock_waits_for_a_stalled_writer_at_most_patience_seconds():
    flow, _, _ = make()
    flow.writer_batch({}, polled_at=100.0)
    flow.take_notifications()
    assert flow.reap_clock(100.0, 4.0) == 100.0
    assert flow.reap_clock(99.0, 4.0) == 99.0  # heard up to a later instant than now: now
    assert flow.reap_clock(102.5, 4.0) == 100.0  # the writer has not polled for 2.5 s: judge up to 100 only
    assert flow.reap_clock(104.0, 4.0) == 100.0
    assert flow.reap_clock(107.0, 4.0) == 103.0  # stalled 7 s: reclaim runs at most E = 4 s late
    # a lease due at 101 (D's last heartbeat ~97 with E = 4) is not reaped while the writer is stalled ...
    assert not 101.0 <= flow.reap_clock(104.9, 4.0)
    # ... and is reaped, at the latest, E after its deadline
    assert 101.0 <= flow.reap_clock(105.0, 4.0)


def test_a_reaped_lease_is_never_written_and_the_memory_of_reaped_leases_is_bounded():
    from leasekit.vllm.pushflow import REAPED_KEPT

    flow, _, _ = make()
    assert flow.begin_write("a") and flow.reap_hold() == ("a",)  # the reap holds "a" back while it is submitted
    flow.end_write()
    assert flow.reap_hold() == () and not flow.write_lock.locked()
    flow.reaped(["a"])
    assert not flow.begin_write("a") and flow.reap_hold() == ()
    flow.refused("a")
    assert flow.take_refused() == ["a"] and flow.take_refused() == []
    flow.reaped([f"x{i}" for i in range(REAPED_KEPT)])
    assert flow.begin_write("a")  # the oldest was forgotten: at most REAPED_KEPT ids are kept
    flow.end_write()
    assert not flow.begin_write(f"x{REAPED_KEPT - 1}") and not flow.begin_write("x0")


def test_a_new_grant_under_a_reaped_id_may_be_written_again():
    flow, leases, _ = make()
    leases["r"] = 6.0
    flow.granted("r")
    flow.reaped(["r"])
    flow.ended("r")
    assert not flow.begin_write("r")
    flow.granted("r")  # a retried request with the same id: a new lease
    assert flow.begin_write("r")


def agents(flow):
    """Lease -> the D agent PushFlow would still name on the lease's WRITE span."""
    return {lease: r.agent for lease, r in flow._regs.items() if r.agent}


def test_the_agent_of_a_registration_never_written_is_forgotten_when_its_lease_is_reaped_or_pruned():
    flow, leases, _ = make()
    leases["r-1a2b3c4d"] = 6.0
    flow.granted("r-1a2b3c4d")
    assert flow.writer_batch({"d-agent": [reg("r-1a2b3c4d")]})
    assert agents(flow) == {"r-1a2b3c4d": "d-agent"}
    del leases["r-1a2b3c4d"]
    with flow.write_lock:
        flow.reaped(["r-1a2b3c4d"])  # expired before its WRITE: nothing else pops it
    assert agents(flow) == {}
    flow.ended("r-1a2b3c4d")
    assert flow._regs == {}  # D asked for no lease end: nothing left to tell
    # registrations accepted, then their leases aborted (never reaped, never written): pruned on later grants
    gone = [f"gone{i}-1a2b3c4d" for i in range(4200)]
    for rid in gone:
        leases[rid] = 6.0
        flow.granted(rid)
    flow.writer_batch({"d-agent": [reg(rid) for rid in gone]})
    for rid in gone:
        del leases[rid]  # aborted: vLLM drops the lease without telling the worker
    assert len(agents(flow)) == 4200
    leases["live-1a2b3c4d"] = 6.0
    flow.granted("live-1a2b3c4d")  # more registrations kept than 4096 + 4 per live lease: pruned
    assert flow._regs == {}
    assert flow.writer_batch({"d-agent": [reg("live-1a2b3c4d")]})
    assert agents(flow) == {"live-1a2b3c4d": "d-agent"}


class DropStats(Stats):
    def __init__(self):
        super().__init__()
        self.drops: dict[str, int] = {}

    def dropped(self, reason, count=1):
        self.drops[reason] = self.drops.get(reason, 0) + count


def test_a_flood_while_the_engine_thread_stalls_is_bounded_counted_and_delays_reclaim_by_at_most_e(monkeypatch):
    import leasekit.vllm.pushflow as pushflow

    monkeypatch.setattr(pushflow, "BACKLOG_MESSAGES", 8)
    now = [100.0]
    flow, leases, drops = make(clock=lambda: now[0])
    flow.writer_batch({"d": [b"HB:a"]}, polled_at=99.0)
    assert flow.reap_clock(100.0, 4.0) == 100.0 and flow.lost_at is None
    # the engine thread takes nothing while a stranger floods: what waits stays at the bound, the rest is counted
    flow.writer_batch({"stranger": [b"x%d" % i for i in range(20)], "d": [b"HB:b"]}, polled_at=100.0)
    waiting = flow.take_notifications()
    assert sum(len(m) for m in waiting.values()) == 8 and waiting["d"] == [b"HB:a"]
    stats = DropStats()
    flow.record(Recorder(), stats)
    assert stats.drops == {"backlog_full": 14} and drops == []  # 21 came, room for 7
    flow.record(Recorder(), stats)
    assert stats.drops == {"backlog_full": 14}  # counted once
    # a heartbeat may have been among the lost: for E after the loss, P judges silence E late
    assert flow.lost_at == 100.0
    assert flow.reap_clock(101.0, 4.0) == 97.0
    assert flow.reap_clock(104.0, 4.0) == 100.0  # E after the loss: back to what the writer polled
    # room again once the engine thread took the backlog
    flow.writer_batch({"d": [b"HB:c"]}, polled_at=105.0)
    assert flow.take_notifications() == {"d": [b"HB:c"]}


def test_the_backlog_is_bounded_in_bytes_and_dropped_registrations_waiting_to_be_logged_are_bounded(monkeypatch):
    import leasekit.vllm.pushflow as pushflow

    monkeypatch.setattr(pushflow, "BACKLOG_BYTES", 100)
    monkeypatch.setattr(pushflow, "BACKLOG_MESSAGES", 3)
    flow, _, drops = make()
    flow.writer_batch({"d": [b"a" * 60, b"b" * 60, b"c" * 30]}, polled_at=1.0)
    assert flow.take_notifications() == {"d": [b"a" * 60, b"c" * 30]}
    for i in range(5):  # registrations the writer thread refused: each a drop to log, 3 wait, 2 only counted
        flow.writer_drop("push_reg_unknown_id", "stranger", f"cmpl-none-{i}")
    stats = DropStats()
    flow.record(Recorder(), stats)
    assert len(drops) == 3 and {d[0] for d in drops} == {"push_reg_unknown_id"}
    assert stats.drops == {"backlog_full": 1, "push_reg_unknown_id": 2}


def test_one_x_request_id_on_two_live_leases_matches_no_registration_until_both_ended():
    """vLLM's writer pairs a registration with the first finished prefill of the same base id: with two leases of
    one base id (a client sent one X-Request-Id twice) it could WRITE one prompt's KV blocks into the other's."""
    flow, leases, drops = make()
    first, second, third = "cmpl-x-0-1a2b3c4d", "cmpl-x-0-5e6f7a8b", "cmpl-x-0-0c0c0c0c"
    leases[first] = 6.0
    flow.granted(first)
    assert flow.live("cmpl-x-0-99999999") == first
    leases[second] = 7.0
    flow.granted(second)
    assert flow.writer_batch({"d-agent": [reg("cmpl-x-0-99999999")]}) == {}  # dropped at once, not held
    flow.record(Recorder(), Stats())
    assert [reason for reason, _, _ in drops] == ["push_reg_ambiguous_id"]
    assert flow.live(first) == flow.live(second) == "\x00ambiguous"  # even P's own id: vLLM falls back to the base id
    leases[third] = 8.0
    flow.granted(third)
    for ended in (first, second):
        del leases[ended]
        flow.ended(ended)
        assert flow.writer_batch({"d-agent": [reg("cmpl-x-0-99999999")]}) == {}  # a late registration may be the ended one's
    del leases[third]
    flow.ended(third)
    leases["cmpl-x-0-77777777"] = 9.0  # every clashing lease ended: the id is free for the next request
    flow.granted("cmpl-x-0-77777777")
    assert flow.writer_batch({"d-agent": [reg("cmpl-x-0-99999999")]}) == {"d-agent": [reg("cmpl-x-0-99999999")]}
    flow.record(Recorder(), Stats())
    assert [reason for reason, _, _ in drops] == ["push_reg_ambiguous_id"] * 3 and not flow._clashes


def test_a_clash_survives_the_prune_of_ended_leases_only_while_a_clashing_lease_lives():
    flow, leases, _ = make()
    leases["x-1a2b3c4d"] = leases["x-5e6f7a8b"] = 6.0
    flow.granted("x-1a2b3c4d")
    flow.granted("x-5e6f7a8b")
    for i in range(4100):  # leases that ended without ended(): the prune runs
        flow.granted(f"gone-{i}")
    assert flow.live("x-99999999") == "\x00ambiguous"
    del leases["x-1a2b3c4d"], leases["x-5e6f7a8b"]
    flow.granted("trigger")
    assert flow.live("x-99999999") is None and not flow._clashes
