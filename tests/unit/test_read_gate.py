"""Fail-closed protocol, pure parts: the LK1 codec, D's read gate, P's verdicts (over a stand-in of
vLLM's worker state) and the fail-closed check with discarded and recomputed reads."""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.chaos import FAIL, PASS, UNKNOWN
from leasekit.chaos.checks import check_fail_closed
from leasekit.lease.codec import (
    REASON_BAD_PROTOCOL,
    Completion,
    DecodeError,
    Verdict,
    decode_notification,
    encode_ack,
    encode_completion,
    encode_hello,
    encode_verdict,
    sequence_token,
    split_protocol_ids,
)
from leasekit.lease.readgate import FAIL as GATE_FAIL
from leasekit.lease.readgate import (
    DISCARDED_OUTCOMES,
    HOLD,
    OUTCOME_ABANDONED,
    OUTCOME_REAPED,
    OUTCOME_TIMEOUT,
    OUTCOME_UNGATED,
    OUTCOME_VERIFIED,
    RELEASED_OUTCOMES,
    USE,
    ReadGate,
    agent_name,
)
from leasekit.vllm.verdictchan import VerdictInbox, encode_hello_payload
from tests.unit.test_checks import lease
from tests.unit.test_p_notifications import TIMING, Worker

E = TIMING.extension_s

_ID = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=64)


@given(_ID, st.booleans())
def test_verdict_round_trips_for_any_id(req_id, ok):
    assert decode_notification(encode_verdict(req_id, ok)) == Verdict(req_id, ok)


@given(st.binary(min_size=1, max_size=600))
def test_hello_is_a_heartbeat_id_that_round_trips_any_payload(payload):
    heartbeat = decode_notification(encode_hello(payload))
    assert split_protocol_ids(heartbeat.req_ids) == (None, payload, ())  # a stock P ignores the id


@pytest.mark.parametrize("raw", [b"LK1:", b"LK1:V:maybe:r", b"LK1:V:ok", b"LK1:HELLO:!!!", b"LK1:HELLO:", b"LK1:X:1"])
def test_malformed_protocol_messages_are_bad_protocol(raw):
    result = decode_notification(raw)
    assert isinstance(result, DecodeError) and result.reason == REASON_BAD_PROTOCOL


def test_stock_messages_are_unchanged_by_the_protocol():
    assert decode_notification(encode_completion("cmpl-1:x", 2)) == Completion("cmpl-1:x", 2)


def test_agent_names_from_vllm_bytes_and_nixl_str_agree():
    assert agent_name(b"abc") == agent_name("abc") == "abc"


def gate(timeout_s=6.0, max_remaining_s=6.0):
    g = ReadGate(timeout_s, max_remaining_s=max_remaining_s, clock=lambda: 0.0)
    g.protect("d1")
    g.expect("d1", "p0", "P1", now=0.0)
    return g


def test_unprotected_reads_are_used_as_stock_does():
    g = ReadGate(6.0)
    g.expect("d1", "p0", "P1")
    assert g.hold("d1", now=0.0) == USE


def test_a_protected_read_waits_for_every_agent_that_served_it():
    g = gate()
    g.expect("d1", "p1", "P1", now=0.0)
    assert g.hold("d1", now=1.0) == HOLD
    g.verdict("p0", "P1", True)
    assert g.resolve(now=1.1) == []
    g.verdict("p1", "P1", True)
    (result,) = g.resolve(now=1.2)
    assert (result.outcome, result.request_id, result.remote_request_id) == (OUTCOME_VERIFIED, "d1", "P1")
    assert result.wait_s == pytest.approx(0.2)
    assert g.held == 0 and not g.is_protected("d1")


def test_one_reaped_answer_discards_the_read_and_cannot_be_overwritten():
    g = gate()
    g.verdict("p0", "P1", False)  # may arrive before D polls the transfer
    g.verdict("p0", "P1", True)
    assert g.hold("d1", now=1.0) == HOLD
    (result,) = g.resolve(now=1.0)
    assert result.outcome == OUTCOME_REAPED


def test_no_answer_times_out_and_a_verdict_from_another_agent_does_not_count():
    g = gate(timeout_s=2.0)
    assert g.hold("d1", now=1.0) == HOLD
    g.verdict("forger", "P1", True)
    assert g.resolve(now=2.9) == []
    (result,) = g.resolve(now=3.0)
    assert result.outcome == OUTCOME_TIMEOUT and result.wait_s == pytest.approx(2.0)


def test_a_protected_read_nobody_was_asked_about_fails_closed():
    g = ReadGate(6.0, clock=lambda: 0.0)
    g.protect("d1")  # the hook failed before expect(): no P agent will answer
    assert g.hold("d1") == GATE_FAIL
    assert [r.outcome for r in g.resolve()] == [OUTCOME_UNGATED]


def test_protection_lasts_until_the_request_finishes_however_long_it_waits():
    g = gate()
    g.protect("d2")
    assert g.hold("d1", now=10_000.0) == HOLD  # no age limit: a read after hours is still gated
    g.finish("d2")
    assert not g.is_protected("d2")
    assert g.resolve(now=10_000.0) == []  # still waiting for P
    g.finish("d1")  # the request finished on D (aborted) while its read was held
    assert not g.is_protected("d1")
    (result,) = g.resolve(now=10_001.0)  # reported, so that vLLM frees its blocks; nothing is left
    assert result.request_id == "d1" and result.outcome == OUTCOME_ABANDONED
    assert OUTCOME_ABANDONED in RELEASED_OUTCOMES and OUTCOME_ABANDONED not in DISCARDED_OUTCOMES
    assert g._reads == {} and g.resolve(now=20_000.0) == []


def test_a_read_still_in_flight_when_its_request_finished_is_abandoned_not_unprotected():
    g = gate()
    g.finish("d1")  # protected by gate(); the read has not finished yet
    assert g.hold("d1", now=1.0) == USE  # used as stock: the request produces no more tokens
    assert g.pop_finished("d1") and not g.pop_finished("d1")
    g.finish("never-protected")
    assert not g.pop_finished("never-protected")
    g.protect("d3")  # protected, but its read was never posted (a full local prefix hit): nothing kept
    g.finish("d3")
    assert g._finished == {} and not g.pop_finished("d3")


def test_a_second_read_of_the_same_p_request_is_not_verified_by_the_first_ones_verdict():
    g = gate()
    g.protect("d2")
    g.expect("d2", "p0", "P1", now=0.0)  # concurrent: the key belongs to d1
    g.verdict("p0", "P1", True)
    assert g.hold("d1", now=0.5) == HOLD and g.hold("d2", now=0.5) == GATE_FAIL
    assert sorted((r.request_id, r.outcome) for r in g.resolve(now=0.5)) == [
        ("d1", OUTCOME_VERIFIED), ("d2", OUTCOME_UNGATED)]
    g.protect("d3")  # a retry soon after: a stale verdict of d1's read could still arrive
    g.expect("d3", "p0", "P1", now=1.0)
    g.verdict("p0", "P1", True)
    assert g.hold("d3", now=1.0) == GATE_FAIL
    g.protect("d4")  # long after: still ungated (P freed P1 at the first completion; a verdict queued
    g.expect("d4", "p0", "P1", now=1e6)  # for d1's read may arrive at any time over ZMQ)
    g.verdict("p0", "P1", True)
    assert g.hold("d4", now=1e6) == GATE_FAIL


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        ReadGate(0)


class DWorkerInbox:
    """A real D verdict inbox on loopback (leasekit/vllm/verdictchan.py): what P sends, as D gets it."""

    def __init__(self):
        self.inbox = VerdictInbox()
        self.endpoint = self.inbox.endpoint_for("127.0.0.1")

    def hello(self) -> bytes:
        return encode_hello(encode_hello_payload(self.endpoint, self.inbox.token))

    def received(self, n: int = 0, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
        """Every message that arrives until ``n`` came (then 50 ms more, to catch extras) or the timeout;
        with ``n = 0``, what arrives within 200 ms (to show that nothing does)."""
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + (timeout_s if n else 0.2)
        while time.monotonic() < deadline:
            batch, malformed = self.inbox.drain()
            assert malformed == 0
            got += batch
            if n and len(got) >= n:
                deadline = min(deadline, time.monotonic() + 0.05)
                n = 0
            time.sleep(0.005)
        return got


@pytest.fixture
def d0():
    inbox = DWorkerInbox()
    yield inbox
    inbox.inbox.close()


def p_worker(fail_closed=True):
    """P's notification components, as P's NIXL agent ``p0`` (its name is on every verdict)."""
    return Worker(fail_closed=fail_closed, agent="p0")


def test_p_answers_each_completion_after_hello_live_ok_late_reaped(d0):
    w = p_worker()
    w.grant("live", 0.0)
    w.step({"d0": [d0.hello(), b"live:1", b"gone:1"]})
    assert d0.received(2) == [("p0", encode_verdict("live", True)), ("p0", encode_verdict("gone", False))]
    w.replies.close()


def test_p_without_fail_closed_ignores_hellos_and_never_notifies_d(d0):
    """leasekit_fail_closed false: P never connects to a D from a hello and sends no verdict and no ack."""
    w = p_worker(fail_closed=False)
    w.grant("live", 0.0)
    w.step({"d0": [d0.hello(), b"HB:live,LK1~5", b"live:1", b"gone:1"]})
    assert d0.received() == [] and w.replies.outbox is None
    assert w.replies.agents == {} and w.replies.pending == {}
    assert "live" not in w.send  # the completion still released the lease, as stock
    assert w.drops() == {"unknown_id": 1}, "only gone:1 (never held); the hello is ignored, as stock"


def test_p_closes_the_least_recently_answered_agent_at_the_cap(monkeypatch, d0):
    import leasekit.vllm.prefill.replies as replies

    monkeypatch.setattr(replies, "MAX_PROTOCOL_AGENTS", 2)
    w = p_worker()
    w.grant("r", 0.0)
    w.step({"a": [d0.hello()], "b": [d0.hello()]})
    w.step({"a": [b"gone:1"]})  # a answered most recently: b is now the least recently used
    w.step({"c": [d0.hello()]})
    assert list(w.replies.agents) == ["a", "c"] and len(w.replies.outbox) == 2
    assert w.replies.outbox.has("a") and not w.replies.outbox.has("b")
    w.replies.close()


def test_p_keeps_live_verdicts_until_the_hello_arrives(d0):
    w = p_worker()
    w.grant("r", 0.0)
    w.step({"d0": [b"r:1", b"gone:1"]})  # only the live lease's verdict is kept
    assert w.replies.outbox is None
    w.step({"d0": [d0.hello()]})
    assert d0.received(1) == [("p0", encode_verdict("r", True))]
    w.replies.close()


TOKEN = b" 0123456789abcdef"


@pytest.mark.parametrize("endpoint", [b"md", b"tcp://" + TOKEN, b"tcp://127.0.0.1:0" + TOKEN, b"tcp://127.0.0.1:99999" + TOKEN,
                                      b"ipc:///tmp/x" + TOKEN, b"tcp://d.example:1" + TOKEN, b"tcp://999.1.1.1:1" + TOKEN,
                                      b"tcp://127.0.0.1:1", b"tcp://127.0.0.1:1 XYZ", b"\xff\xfe",
                                      b"tcp://" + b"1" * 300 + b":1" + TOKEN])
def test_p_refuses_a_hello_that_names_no_tcp_endpoint_and_token(endpoint):
    w = p_worker()
    w.grant("r", 0.0)
    w.step({"d0": [encode_hello(endpoint), b"r:1"]})
    assert w.drops() == {"bad_hello": 1}
    assert w.replies.agents == {} and (w.replies.outbox is None or len(w.replies.outbox) == 0)


def test_a_later_hello_moves_the_agent_to_its_new_endpoint(d0):
    """D's worker re-hellos after a timeout, possibly from another address; the latest endpoint wins, so
    a forged hello cannot keep a D's verdicts away for longer than one of its reads."""
    other = DWorkerInbox()
    try:
        w = p_worker()
        w.grant("r", 0.0)
        w.grant("s", 0.0)
        w.step({"d0": [other.hello(), b"r:1"]})
        assert other.received(1) == [("p0", encode_verdict("r", True))]
        w.step({"d0": [d0.hello(), b"s:1"]})
        assert d0.received(1) == [("p0", encode_verdict("s", True))] and other.received() == []
        w.replies.close()
    finally:
        other.inbox.close()


def test_a_verdict_or_ack_as_a_nixl_notification_is_dropped():
    """Version 2 sends them over ZMQ only: one arriving over NIXL is a peer's mistake or a forgery."""
    w = p_worker()
    w.grant("P1", 0.0)
    w.step({"p0": [encode_verdict("P1", False), encode_ack(1, 1.0, ["P1"])]})
    assert w.drops() == {"bad_protocol": 2}
    assert "P1" in w.send and w.replies.agents == {}, "neither ended the lease nor made p0 a protocol agent"


def test_fail_closed_accepts_a_discarded_read_only_with_matching_tokens():
    expired = [lease("a", end=6.0), lease("b", end=6.0), lease("c", end=6.0), lease("d", end=6.0)]
    served = {rid: 130.0 for rid in "abcd"}  # all after expiry (grant 100 + 6)
    result = check_fail_closed(expired, served, {}, {"a": "timeout", "b": "reaped", "c": "timeout"},
                               {"a": True, "b": False, "c": None})
    verdicts = {row.request_id: row.verdict for row in result.rows}
    assert verdicts == {"a": PASS, "b": FAIL, "c": UNKNOWN, "d": FAIL}
    assert result.verdict == FAIL
    ok = check_fail_closed(expired[:1], served, {}, {"a": "reaped"}, {"a": True})
    assert ok.verdict == PASS and "1 recomputed" in ok.summary


def test_acknowledged_heartbeats_let_a_read_through_without_waiting():
    g = gate()
    seq = g.heartbeat_sent("p0", now=1.0)
    g.ack("p0", seq, 4.0, ["P1"])  # held until at least 1 + 4 / K = 4.27 on D's clock (K = 1.1 / 0.9)
    assert g.hold("d1", now=4.2) == HOLD
    (result,) = g.resolve(now=4.2)
    assert result.outcome == OUTCOME_VERIFIED and result.wait_s == 0.0
    g.verdict("p0", "P1", True)  # P's verdict still arrives; nothing keeps it
    assert g._reads == {}


def test_a_read_seen_after_the_horizon_waits_for_the_verdict():
    g = gate()
    g.ack("p0", g.heartbeat_sent("p0", now=1.0), 4.0, ["P1"])
    assert g.hold("d1", now=4.3) == HOLD  # past 1 + 4 / K: P's clock may have run 10 % fast, D's 10 % slow
    assert g.resolve(now=4.3) == []


def test_an_ack_claims_at_most_the_lease_duration():
    g = gate(max_remaining_s=6.0)
    g.ack("p0", g.heartbeat_sent("p0", now=1.0), 1e9, ["P1"])  # forged or broken: cut to 1 + 6 = 7
    assert g.hold("d1", now=7.5) == HOLD
    assert g.resolve(now=7.5) == []


def test_acks_match_their_own_send_whatever_was_lost():
    g = gate()
    g.heartbeat_sent("p0", now=1.0)  # lost: never acknowledged
    g.ack("p0", g.heartbeat_sent("p0", now=2.0), 4.0, ["P1"])  # horizon 2 + 4 / K = 5.27 (from 1: 4.27)
    assert g.hold("d1", now=5.0) == HOLD
    assert [r.outcome for r in g.resolve(now=5.0)] == [OUTCOME_VERIFIED]


def test_unknown_or_repeated_acks_are_ignored():
    g = gate()
    seq = g.heartbeat_sent("p0", now=1.0)
    g.ack("p0", seq + 7, 100.0, ["P1"])  # no such send
    g.ack("forger", seq, 100.0, ["P1"])  # not that agent's send
    assert g.hold("d1", now=10.0) == HOLD
    assert g.resolve(now=10.0) == []
    g.ack("p0", seq, 4.0, ["P1"])
    g.ack("p0", seq, 100.0, ["P1"])  # a replay: the send was consumed
    assert g.resolve(now=10.0) == []


@given(st.integers(0, 10**9), st.floats(0, 1e5), st.lists(_ID.filter(lambda i: "," not in i), max_size=5))
def test_ack_round_trips(seq, remaining_s, ids):
    ack = decode_notification(encode_ack(seq, remaining_s, ids))
    assert (ack.seq, ack.req_ids) == (seq, tuple(ids)) and ack.remaining_s <= remaining_s


def test_sequence_token_is_split_off_a_heartbeat():
    assert split_protocol_ids(["a", sequence_token(12), "b"]) == (12, None, ("a", "b"))
    assert split_protocol_ids(["a", "LK1~x", "LK1~H~!!"]) == (None, None, ("a", "LK1~x", "LK1~H~!!"))


def test_p_acknowledges_sequenced_heartbeats_of_protocol_agents_only(d0):
    w = p_worker()
    w.grant("r", time.perf_counter())  # the stand-in's clock is perf_counter, as vLLM's
    w.step({"d0": [b"HB:r,unknown,LK1~5"]})
    assert w.replies.outbox is None  # no hello yet: nothing new on the wire
    w.step({"d0": [d0.hello(), b"HB:r,unknown,LK1~6", b"HB:unknown,LK1~7", b"HB:r"]})
    acks = [decode_notification(msg) for agent, msg in d0.received(2)]
    assert [(a.seq, a.req_ids) for a in acks] == [(6, ("r",)), (7, ())]
    assert E - 0.1 < acks[0].remaining_s <= TIMING.lease_duration_s
    w.replies.close()


def test_fail_closed_is_on_by_default_and_a_bad_value_is_refused_with_the_fix():
    from leasekit.lease.settings import ReadGateConfigError, fail_closed_enabled, verdict_timeout

    assert fail_closed_enabled({}) is True
    assert fail_closed_enabled({"leasekit_fail_closed": False}) is False
    with pytest.raises(ReadGateConfigError, match="leasekit_fail_closed.*true or false"):
        fail_closed_enabled({"leasekit_fail_closed": "yes"})
    assert verdict_timeout({}, 900.0) == 600.0  # a long lease still starts: default min(L, 600)
    assert verdict_timeout({}, 0.01) == 0.05  # a tiny L (linted elsewhere) still starts: clamped default
    with pytest.raises(ReadGateConfigError, match=r"\[0.05, 86400\]"):
        verdict_timeout({"leasekit_verdict_timeout_s": 0}, 6.0)


def test_an_ack_naming_thousands_of_leases_is_cut_to_fit_d_inbox(d0):
    """D's inbox disconnects a peer sending a frame over 64 KiB (and loses what follows): P names at most
    60 KiB of ids in one ack (fewer leases named is still true), and the verdict after it arrives."""
    from leasekit.vllm.verdictchan import MAX_ACK_BYTES, MAX_MESSAGE_BYTES

    w = p_worker()
    now = time.perf_counter()
    ids = [f"cmpl-{i:036d}" for i in range(2000)]  # 41 chars each: 84 KB of ids
    for rid in ids:
        w.grant(rid, now)
    w.step({"d0": [d0.hello(), ("HB:" + ",".join(ids) + ",LK1~9").encode(), ids[0].encode() + b":1"]})
    (agent, raw), verdict = d0.received(2)
    ack = decode_notification(raw)
    assert len(raw) <= MAX_MESSAGE_BYTES and 0 < len(ack.req_ids) < len(ids)
    assert ack.req_ids == tuple(ids[:len(ack.req_ids)]) and len(",".join(ack.req_ids)) <= MAX_ACK_BYTES
    assert verdict == ("p0", encode_verdict(ids[0], True))
    w.replies.close()
