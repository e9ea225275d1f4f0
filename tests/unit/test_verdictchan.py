"""The fail-closed protocol's P -> D channel (leasekit/vllm/verdictchan.py) over real loopback ZMQ:
endpoints, delivery, a D that is gone, junk and closing."""

import socket
import time

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

import leasekit.vllm.verdictchan as vc
from leasekit.vllm.verdictchan import (
    Hello,
    VerdictInbox,
    VerdictOutbox,
    check_endpoint,
    decode_hello_payload,
    encode_hello_payload,
    local_address_towards,
)


def drain_until(inbox: VerdictInbox, n: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += inbox.drain()[0]
        time.sleep(0.005)
    return got


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5600", "tcp://10.0.0.7:1", "tcp://[::1]:65535",
                                      "tcp://[2001:db8::7]:80"])
def test_tcp_endpoints_are_accepted(endpoint):
    assert check_endpoint(endpoint) is None


@pytest.mark.parametrize("endpoint,why", [
    ("tcp://127.0.0.1:0", "not in [1, 65535]"),
    ("tcp://127.0.0.1:70000", "not in [1, 65535]"),
    ("ipc:///tmp/x", "not tcp://"),
    ("tcp://127.0.0.1", "not tcp://"),
    ("tcp://a b:1", "not tcp://"),
    ("tcp://d-7.example.net:1", "not tcp://"),  # a name: libzmq would resolve it in its I/O thread
    ("tcp://999.1.1.1:1", "not an IP address"),
    ("tcp://[::g]:1", "not tcp://"),
    ("tcp://[1::2::3]:1", "not an IP address"),
    ("tcp://" + "1" * 300 + ":1", "characters >"),
    ("tcp://[1.2.3.4]:1", "IPv6 goes in brackets"),
    ("tcp://0.0.0.0:1", "unspecified or multicast"),
    ("tcp://[::]:1", "unspecified or multicast"),
    ("tcp://224.0.0.1:1", "unspecified or multicast"),
    (b"tcp://127.0.0.1:1", "not str"),
])
def test_anything_else_is_refused_with_the_reason(endpoint, why):
    assert why in check_endpoint(endpoint)


@given(st.text(max_size=80))
def test_check_endpoint_never_raises(text):
    assert check_endpoint(text) is None or isinstance(check_endpoint(text), str)


def test_the_local_address_towards_loopback_is_loopback():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    with pytest.raises(OSError):
        local_address_towards("no-such-host.invalid")


def test_verdicts_reach_the_inbox_in_order_named_by_the_sender():
    inbox = VerdictInbox()
    outbox = VerdictOutbox("p-agent")
    try:
        endpoint = inbox.endpoint_for("127.0.0.1")
        assert endpoint.startswith("tcp://127.0.0.1:") and inbox.endpoint_for("127.0.0.1") == endpoint
        assert outbox.connect("d-agent", endpoint, inbox.token) is True
        for i in range(100):
            outbox.send("d-agent", b"LK1:V:ok:r%d" % i)
        got = drain_until(inbox, 100)
        assert got == [("p-agent", b"LK1:V:ok:r%d" % i) for i in range(100)]
        with pytest.raises(KeyError):
            outbox.send("never-said-hello", b"x")
    finally:
        outbox.close()
        inbox.close()


def test_messages_with_another_inbox_token_are_dropped():
    """A message queued for an earlier D worker that had the same port, or sent by anyone who only opened
    a TCP connection, never reaches the gate."""
    inbox = VerdictInbox()
    outbox = VerdictOutbox("p-agent")
    try:
        endpoint = inbox.endpoint_for("127.0.0.1")
        outbox.connect("old-d", endpoint, "0" * 16 if inbox.token != "0" * 16 else "1" * 16)
        outbox.connect("d", endpoint, inbox.token)
        outbox.send("old-d", b"LK1:V:ok:stale")
        outbox.send("d", b"LK1:V:ok:fresh")
        got, malformed = [], 0
        deadline = time.monotonic() + 5.0
        while (not got or not malformed) and time.monotonic() < deadline:
            batch, bad = inbox.drain()
            got, malformed = got + batch, malformed + bad
            time.sleep(0.005)
        assert got == [("p-agent", b"LK1:V:ok:fresh")] and malformed == 1
    finally:
        outbox.close()
        inbox.close()


def test_hello_payload_round_trips_and_refuses_what_is_not_endpoint_and_token():
    assert decode_hello_payload(encode_hello_payload("tcp://10.0.0.7:41234", "0123456789abcdef")) == Hello(
        "tcp://10.0.0.7:41234", "0123456789abcdef")
    proved = encode_hello_payload("tcp://10.0.0.7:41234", "0123456789abcdef", "cmpl-é1", "fedcba9876543210")
    assert decode_hello_payload(proved) == Hello("tcp://10.0.0.7:41234", "0123456789abcdef", "cmpl-é1",
                                                 "fedcba9876543210")
    with pytest.raises(ValueError):
        encode_hello_payload("tcp://10.0.0.7:41234", "0123456789abcdef", "r")  # a request id without its tag
    for bad in (b"tcp://10.0.0.7:41234", b"tcp://10.0.0.7:41234 0123", b"tcp://10.0.0.7:41234 0123456789ABCDEF",
                b"tcp://h.example:1 0123456789abcdef", b"\xff", b"",
                b"tcp://10.0.0.7:41234 0123456789abcdef r", b"tcp://10.0.0.7:41234 0123456789abcdef r FEDCBA9876543210",
                b"tcp://10.0.0.7:41234 0123456789abcdef r\x01 fedcba9876543210"):
        assert isinstance(decode_hello_payload(bad), str)
    with pytest.raises(ValueError, match="token"):
        VerdictOutbox("p").connect("d", "tcp://127.0.0.1:1", "nope")


def test_sending_to_a_d_that_is_gone_never_blocks_and_fails_once_the_queue_is_full(monkeypatch):
    monkeypatch.setattr(vc, "SEND_HWM", 8)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outbox = VerdictOutbox("p-agent")
    try:
        outbox.connect("gone", f"tcp://127.0.0.1:{port}", "0123456789abcdef")
        started = time.monotonic()
        sent = 0
        with pytest.raises(zmq.Again):
            for _ in range(1000):
                outbox.send("gone", b"LK1:V:ok:r")
                sent += 1
        assert sent <= 16 and time.monotonic() - started < 1.0
        outbox.remove("gone")
        assert len(outbox) == 0 and not outbox.has("gone")
    finally:
        outbox.close()


def test_p_can_hold_more_agents_than_libzmqs_default_socket_limit():
    outbox = VerdictOutbox("p-agent")
    try:
        for i in range(1100):  # libzmq's default ZMQ_MAX_SOCKETS is 1023
            outbox.connect(f"d{i}", "tcp://127.0.0.1:9", "0123456789abcdef")
        assert len(outbox) == 1100
    finally:
        outbox.close()


def test_a_repeated_hello_keeps_the_socket_and_a_new_endpoint_replaces_it():
    outbox = VerdictOutbox("p-agent")
    try:
        assert outbox.connect("d", "tcp://127.0.0.1:9", "0123456789abcdef") is True
        first = outbox._sockets["d"][2]
        assert outbox.connect("d", "tcp://127.0.0.1:9", "0123456789abcdef") is False
        assert outbox._sockets["d"][2] is first  # what it queued (verdicts P just sent) is not lost
        assert outbox.connect("d", "tcp://127.0.0.1:10", "0123456789abcdef") is True
        assert outbox._sockets["d"][2] is not first and first.closed and len(outbox) == 1
    finally:
        outbox.close()


def test_a_host_without_a_route_is_not_asked_again_for_a_while():
    calls = []

    def route(host):
        calls.append(host)
        raise OSError("no route")

    now = [0.0]
    inbox = VerdictInbox(route=route, clock=lambda: now[0])
    for _ in range(3):
        with pytest.raises(OSError):
            inbox.endpoint_for("10.9.9.9")
    assert calls == ["10.9.9.9"]
    now[0] = vc.ROUTE_RETRY_S + 1
    with pytest.raises(OSError):
        inbox.endpoint_for("10.9.9.9")
    assert calls == ["10.9.9.9"] * 2
    inbox.close()


def test_a_frame_above_the_limit_disconnects_its_sender_and_the_inbox_goes_on():
    inbox = VerdictInbox()
    try:
        endpoint = inbox.endpoint_for("127.0.0.1")
        ctx = zmq.Context()
        big = ctx.socket(zmq.PUSH)
        big.connect(endpoint)
        big.send_multipart([b"p", inbox.token.encode(), b"x" * (vc.MAX_MESSAGE_BYTES + 1)])
        good = VerdictOutbox("p-agent")
        good.connect("d", endpoint, inbox.token)
        good.send("d", b"LK1:V:reaped:r")
        assert drain_until(inbox, 1) == [("p-agent", b"LK1:V:reaped:r")]
        time.sleep(0.1)
        assert inbox.drain() == ([], 0)
        good.close()
        big.close(linger=0)
        ctx.term()
    finally:
        inbox.close()


def test_close_is_idempotent_and_an_unbound_inbox_drains_nothing():
    inbox = VerdictInbox()
    assert inbox.drain() == ([], 0) and inbox.endpoints == ()
    inbox.close()
    inbox.close()
    outbox = VerdictOutbox("p")
    outbox.close()
    outbox.close()
