"""P telling a LeaseKit D that a push lease ended without a WRITE (leasekit/lease/pushend.py, the guard's
``push_reg_lease_ended``, PushFlow's bookkeeping, and both sides of LeaseKitPushWorker in leasekit/vllm/pushend.py):
D fails the load of a request whose WRITE will never come instead of waiting for it (and keeping its KV blocks) for
ever. The real-pair proof is the stall-writer-long-push scenario."""

from __future__ import annotations

import queue
import threading

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease.pushend import (OPT_IN_KEY, PUSH_END_PREFIX, PushEndError, asked_for_push_end, decode_push_end,
                                    encode_push_end, is_push_end)
from leasekit.lease.pushreg import LEASE_ENDED, PUSH_REG_PREFIX, decode_push_reg
from leasekit.vllm.pushflow import PushFlow


def reg(request_id: str, *, ask: bool = True, host: str = "10.0.0.2") -> bytes:
    data = {"request_id": request_id, "decode_engine_id": "d-engine", "decode_host": host, "decode_port": 5600,
            "decode_tp_size": 1, "local_block_ids": [[4, 5]], "remote_engine_id": "p", "remote_host": "10.0.0.1",
            "remote_port": 5500, "remote_tp_size": 1, "remote_pp_size": 1}
    if ask:
        data[OPT_IN_KEY] = 1
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(data)


def test_the_lease_end_notification_round_trips_and_refuses_what_is_not_an_id():
    msg = encode_push_end("cmpl-x-0-1a2b3c4d")
    assert msg == PUSH_END_PREFIX + b"cmpl-x-0-1a2b3c4d" and is_push_end(msg) and not is_push_end(b"HB:x")
    assert decode_push_end(msg) == "cmpl-x-0-1a2b3c4d"
    assert decode_push_end(encode_push_end("a,b")) == "a,b"  # registration ids may hold commas
    for bad in (PUSH_END_PREFIX, PUSH_END_PREFIX + b"\xff\xfe", PUSH_END_PREFIX + b"a\x00b", PUSH_END_PREFIX + b"x" * 5000):
        assert isinstance(decode_push_end(bad), PushEndError) and decode_push_end(bad).reason == "bad_id"
    for bad_id in ("", "x" * 1025, "a\nb"):
        with pytest.raises(ValueError, match="d_request_id: a request id of 1..1024 characters"):
            encode_push_end(bad_id)


def test_a_registration_asks_for_it_only_with_the_integer_one():
    assert asked_for_push_end({OPT_IN_KEY: 1}) and not asked_for_push_end({OPT_IN_KEY: True})
    assert not asked_for_push_end({OPT_IN_KEY: "1"}) and not asked_for_push_end({}) and not asked_for_push_end([1])
    assert decode_push_reg(reg("r"), max_bytes=1 << 20).push_end
    assert not decode_push_reg(reg("r", ask=False), max_bytes=1 << 20).push_end


def make_flow(now=None):
    leases: dict[str, float] = {}
    drops: list[tuple[str, str, str]] = []
    told: list[tuple[str, str]] = []
    now = now if now is not None else [0.0]
    flow = PushFlow(leases, allowed=lambda host: host == "10.0.0.2", hold_s=1.0, max_bytes=1 << 20,
                    drop=lambda reason, agent, detail: drops.append((reason, agent, detail)), clock=lambda: now[0],
                    notify_end=lambda agent, rid: told.append((agent, rid)))
    return flow, leases, drops, told


RECORDER = type("R", (), {"grant_time": lambda s, r: None, "annotate": lambda s, r, a: True})()
STATS = type("S", (), {"push_write": lambda s, o: None, "dropped": lambda s, r, c: None})()


def test_a_registration_for_a_lease_reaped_unregistered_is_dropped_after_the_hold_and_its_d_told_once():
    now = [0.0]
    flow, leases, drops, told = make_flow(now)
    for lease in ("cmpl-a-0-1a2b3c4d", "cmpl-b-0-1a2b3c4d"):
        leases[lease] = 6.0
        flow.granted(lease)
    for lease in ("cmpl-a-0-1a2b3c4d", "cmpl-b-0-1a2b3c4d"):
        del leases[lease]
    with flow.write_lock:
        flow.reaped(["cmpl-a-0-1a2b3c4d", "cmpl-b-0-1a2b3c4d"])
    assert flow.was_reaped("cmpl-a-0-99999999") and not flow.was_reaped("cmpl-c-0-99999999")
    batch = {"d-agent": [reg("cmpl-a-0-99999999"), reg("cmpl-b-0-99999999", ask=False), reg("cmpl-c-0-99999999")]}
    assert flow.writer_batch(batch) == {} and told == []  # held: a new grant under that id may still come
    now[0] = 1.0
    assert flow.writer_batch({"d-agent": [reg("cmpl-a-0-99999999")] * 3}) == {}  # a replay: told once
    assert told == [("d-agent", "cmpl-a-0-99999999")]  # the one that asked; never the unknown one
    now[0] = 2.0
    flow.writer_batch({})
    flow.record(RECORDER, STATS)
    assert sorted(reason for reason, _, _ in drops) == ["push_reg_lease_ended"] * 5 + ["push_reg_unknown_id"]
    assert told == [("d-agent", "cmpl-a-0-99999999")]


def test_a_new_grant_within_the_hold_takes_the_registration_instead():
    now = [0.0]
    flow, leases, _, told = make_flow(now)
    leases["cmpl-a-0-1a2b3c4d"] = 6.0
    flow.granted("cmpl-a-0-1a2b3c4d")
    del leases["cmpl-a-0-1a2b3c4d"]
    with flow.write_lock:
        flow.reaped(["cmpl-a-0-1a2b3c4d"])
    assert flow.writer_batch({"d-agent": [reg("cmpl-a-0-77777777")]}) == {}  # a retry's registration before its grant
    leases["cmpl-a-0-5e6f7a8b"] = 12.0
    flow.granted("cmpl-a-0-5e6f7a8b")
    now[0] = 0.5
    assert flow.writer_batch({}) == {"d-agent": [reg("cmpl-a-0-77777777")]} and told == []


def test_no_registration_ever_tells_d_about_a_lease_that_had_one_accepted_its_write_may_be_in_flight():
    now = [0.0]
    flow, leases, drops, told = make_flow(now)
    leases["r-1a2b3c4d"] = 6.0
    flow.granted("r-1a2b3c4d")
    assert flow.writer_batch({"d-rank0": [reg("r-99999999")]})
    flow.issued("r-1a2b3c4d", handles=1)  # the WRITE is in flight when the lease expires
    del leases["r-1a2b3c4d"]
    with flow.write_lock:
        flow.reaped(["r-1a2b3c4d"])
    flow.ended("r-1a2b3c4d")
    assert not flow.was_reaped("r-99999999")
    assert flow.writer_batch({"d-rank1": [reg("r-99999999")]}) == {}  # D TP > P TP: the second D rank's registration
    now[0] = 5.0
    flow.writer_batch({})
    flow.record(RECORDER, STATS)
    assert told == [] and [reason for reason, _, _ in drops] == ["push_reg_unknown_id"]


def test_a_refused_write_names_ds_request_only_when_its_registration_asked_and_survives_the_leases_end():
    flow, leases, _, _ = make_flow()
    for lease in ("r1-1a2b3c4d", "r2-1a2b3c4d"):
        leases[lease] = 6.0
        flow.granted(lease)
    assert flow.writer_batch({"d": [reg("r1-99999999"), reg("r2-99999999", ask=False)]})
    with flow.write_lock:
        flow.reaped(["r1-1a2b3c4d", "r2-1a2b3c4d"])
    for lease in ("r1-1a2b3c4d", "r2-1a2b3c4d"):
        del leases[lease]
        flow.ended(lease)  # vLLM reports the expired lease finished before the writer reaches its WRITE
    assert not flow.begin_write("r1-1a2b3c4d")
    assert flow.refused("r1-1a2b3c4d") == "r1-99999999" and flow.refused("r2-1a2b3c4d") is None
    assert flow.refused("r1-1a2b3c4d") is None  # told once


def test_a_written_lease_has_no_lease_end_to_tell():
    flow, leases, _, _ = make_flow()
    leases["w-1a2b3c4d"] = 6.0
    flow.granted("w-1a2b3c4d")
    assert flow.writer_batch({"d": [reg("w-99999999")]})
    flow.issued("w-1a2b3c4d", handles=1)
    assert flow.refused("w-1a2b3c4d") is None


class Intake:
    def __init__(self):
        self.drops: list[tuple[str, str]] = []

    def drop(self, reason, agent, detail):
        self.drops.append((reason, agent))


@pytest.fixture
def worker():
    pytest.importorskip("vllm")
    from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
    from leasekit.vllm.push import LeaseKitPushWorker

    w = object.__new__(LeaseKitPushWorker)
    w._lk_ready = True
    w._lk_p = type("P", (), {"intake": Intake()})()
    w._lk_hb = type("HB", (), {"notes": [], "note": lambda self, rid, event, attrs: self.notes.append((rid, event))})()
    w._lk_end_warning = RateLimitedWarning(lease_logger())
    w._lk_errors = type("E", (), {"errors": [], "report": lambda self, where, exc: self.errors.append(where)})()
    w._failed_recv_reqs = queue.Queue()
    w._handshake_lock = threading.Lock()
    w._remote_agents = {"p-engine": {0: "p-agent-0"}, "d-engine": {0: "d-agent-0", 1: "d-agent-1"}}
    w._recving_metadata = {"waits": type("M", (), {"remote": type("R", (), {"engine_id": "p-engine"})()})()}
    sent: list[tuple[str, bytes]] = []
    w.nixl_wrapper = type("W", (), {"send_notif": lambda self, agent, notif_msg: sent.append((agent, notif_msg))})()
    w.sent = sent
    return w


def test_d_fails_the_load_only_on_a_lease_end_from_its_p_engine_for_a_request_it_waits_on(worker):
    worker._lk_push_end_received("stranger", encode_push_end("waits"))
    worker._lk_push_end_received("p-agent-0", encode_push_end("gone"))
    worker._lk_push_end_received("p-agent-0", PUSH_END_PREFIX + b"\xff")
    assert worker._lk_p.intake.drops == [("foreign_write", "stranger"), ("unknown_id", "p-agent-0"), ("bad_id", "p-agent-0")]
    assert worker._failed_recv_reqs.empty()
    worker._lk_push_end_received(b"p-agent-0", encode_push_end("waits"))  # NIXL names senders in bytes
    assert worker._failed_recv_reqs.get_nowait() == "waits" and worker._lk_hb.notes == [("waits", "lease_ended_by_p")]


def test_d_asks_for_lease_ends_only_where_one_p_rank_writes_the_request(worker):
    regs = {"one": {"remote_tp_size": 1, "remote_pp_size": 1}, "tp": {"remote_tp_size": 2, "remote_pp_size": 1},
            "pp": {"remote_tp_size": 1, "remote_pp_size": 2}, "old": {}}
    worker.world_size = 1
    worker._lk_ask_for_push_end(type("Meta", (), {"push_registrations": regs})())
    assert [rid for rid, r in regs.items() if r.get(OPT_IN_KEY) == 1] == ["one", "old"]
    worker.world_size = 2  # D TP 2, P TP 2: one P rank per D rank
    worker._lk_ask_for_push_end(type("Meta", (), {"push_registrations": regs})())
    assert regs["tp"][OPT_IN_KEY] == 1 and OPT_IN_KEY not in regs["pp"]


def test_p_tells_every_agent_of_the_d_engine_or_only_a_known_registering_agent(worker):
    worker._lk_send_push_end(worker._lk_known_agents("d-engine"), "cmpl-d-0-1a2b3c4d")
    assert worker.sent == [("d-agent-0", b"LKEND:cmpl-d-0-1a2b3c4d"), ("d-agent-1", b"LKEND:cmpl-d-0-1a2b3c4d")]
    worker.sent.clear()
    worker._lk_end_to_agent("stranger", "cmpl-d-0-1a2b3c4d")  # P dials no agent it has not handshaked with
    worker._lk_end_to_agent(b"d-agent-1", "cmpl-d-0-1a2b3c4d")  # the sender of a registration, as NIXL names it
    assert worker.sent == [("d-agent-1", b"LKEND:cmpl-d-0-1a2b3c4d")]
    worker._lk_send_push_end({"d-agent-0"}, "bad\nid")
    assert worker._lk_errors.errors == ["push_end"] and len(worker.sent) == 1


@given(st.binary(max_size=6000))
def test_any_bytes_after_the_prefix_decode_to_an_id_or_bad_id_never_an_exception(body):
    got = decode_push_end(PUSH_END_PREFIX + body)
    assert (isinstance(got, PushEndError) and got.reason == "bad_id") or encode_push_end(got) == PUSH_END_PREFIX + body


@given(st.text(min_size=1, max_size=1024).filter(str.isprintable))
def test_every_printable_id_round_trips(rid):
    assert decode_push_end(encode_push_end(rid)) == rid


def test_a_held_registration_wakes_vllms_writer_when_its_hold_ends():
    """vLLM's writer polls again only when woken: an idle P would otherwise never decide a held registration."""
    woken = threading.Event()
    now = [0.0]
    leases: dict[str, float] = {}
    flow = PushFlow(leases, allowed=lambda host: True, hold_s=0.2, max_bytes=1 << 20, drop=lambda *a: None,
                    clock=lambda: now[0], wake=woken.set)
    assert flow.writer_batch({"d": [reg("nobody-99999999")]}) == {} and flow.guard.held == 1
    assert not woken.wait(0.1) and woken.wait(2.0)  # after the hold (0.2 s), not before
    first = flow._wake_timer
    flow.writer_batch({})
    assert flow._wake_timer is first or not first.is_alive()  # one pending wake at a time


def test_a_registered_lease_is_remembered_until_it_ends_however_many_others_come_meanwhile():
    flow, leases, _, _ = make_flow()
    leases["old-1a2b3c4d"] = 6.0
    flow.granted("old-1a2b3c4d")
    assert flow.writer_batch({"d": [reg("old-99999999")]})  # its WRITE may now be issued
    for i in range(5000):  # a busy P: thousands of leases registered, written and ended while it waits
        rid = f"r{i}-1a2b3c4d"
        leases[rid] = 6.0
        flow.granted(rid)
        flow.writer_batch({"d": [reg(f"r{i}-99999999")]})
        del leases[rid]
        flow.ended(rid)
    del leases["old-1a2b3c4d"]
    with flow.write_lock:
        flow.reaped(["old-1a2b3c4d"])
    assert not flow.was_reaped("old-99999999")  # a second D rank's registration is never answered with a lease end
    flow.ended("old-1a2b3c4d")
    assert not flow.was_reaped("old-99999999")
    assert list(flow._regs) == ["old-1a2b3c4d"]  # bounded: the 5000 ended leases left nothing behind ...
    assert flow.refused("old-1a2b3c4d") == "old-99999999" and flow._regs == {}  # ... and D is told once


def test_a_failing_lease_end_send_loses_none_of_the_batchs_accepted_registrations(caplog):
    from leasekit.lease.peerref import peer_ref

    now = [0.0]
    flow, leases, drops, _ = make_flow(now)
    agent = "d-agent-6f1c0d2e-9b7a-4c1e-8f3d-2a5b7c9e1f04"  # NIXL names agents by UUID

    def broken(who, rid):
        raise RuntimeError(f"nixl agent {who} gone")

    flow._notify_end = broken
    leases["cmpl-a-0-1a2b3c4d"] = 6.0
    flow.granted("cmpl-a-0-1a2b3c4d")
    del leases["cmpl-a-0-1a2b3c4d"]
    with flow.write_lock:
        flow.reaped(["cmpl-a-0-1a2b3c4d"])
    assert flow.writer_batch({agent: [reg("cmpl-a-0-99999999")]}) == {}  # held
    now[0] = 1.0
    leases["cmpl-b-0-1a2b3c4d"] = 6.0
    flow.granted("cmpl-b-0-1a2b3c4d")
    with caplog.at_level("WARNING"):  # the hold ends in the batch that brings b's registration: the send raises
        out = flow.writer_batch({agent: [reg("cmpl-b-0-99999999")]})
    assert out == {agent: [reg("cmpl-b-0-99999999")]}
    assert "could not tell D that its lease ended" in caplog.text and "gone" in caplog.text
    assert agent not in caplog.text and peer_ref(agent) in caplog.text  # a peer's name is logged as its reference


def test_a_queued_drop_keeps_a_bounded_detail():
    from leasekit.vllm.pushflow import DETAIL_CHARS

    flow, _, drops, _ = make_flow()
    flow.writer_drop("push_reg_malformed", "d-agent", "x" * 100_000)
    flow.record(RECORDER, STATS)
    assert drops == [("push_reg_malformed", "d-agent", "x" * DETAIL_CHARS)]
