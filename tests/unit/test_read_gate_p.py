"""P's verdicts and acks (over a stand-in of vLLM's worker state) as a real D verdict inbox receives them."""

import time

import pytest

from leasekit.lease.codec import decode_notification, encode_ack, encode_hello, encode_verdict
from leasekit.vllm.verdictchan import VerdictInbox, encode_hello_payload
from tests.unit.test_p_notifications import TIMING, Worker

E = TIMING.extension_s


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
