"""P's NIXL side-channel handshake listener under malformed requests, on a real LeaseKitConnector
pair (issue 6 point 8). Stock vLLM 0.32's listener thread dies on the first one (for good: no new D
can connect while /health stays 200; tests/unit/test_handshake_listener.py shows it on vLLM's own
code). LeaseKit P must refuse and count every bad request, keep answering handshakes, keep serving
requests, accept a brand-new D engine, and show it all on /metrics and in ``leasekit status``.

Runs on the pair shared with tests/integration/test_hostile_peer.py (:mod:`tests.shared_pair`; that
module may have run first: it sends no side-channel requests but leaves expired leases behind)."""

import json
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from leasekit.chaos.peer import GET_META_MSG, NixlPeer, handshake_request, side_channel_request
from leasekit.telemetry import metrics as m
from leasekit.vllm.prefill.listener import MAX_FRAME_BYTES, MAX_REQUEST_BYTES

pytestmark = pytest.mark.pair
HOST = "127.0.0.1"
UP = m.HANDSHAKE_LISTENER_UP.name
SERVED = m.HANDSHAKE_REQUESTS.sample_names[0]
BAD = m.HANDSHAKE_BAD_REQUESTS.sample_names[0]

# (reason, payload) sent from a ZMQ REQ socket, as D's would be
MALFORMED = [
    ("bad_msgpack", b"\xc1"),  # invalid msgpack: stock P's listener dies on it
    ("bad_msgpack", b"\x93\xc4\x0cget_meta"),  # truncated
    ("unknown_rank", handshake_request(0, 99)),  # stock P's listener dies on it (KeyError)
    ("unknown_rank", handshake_request(7, 0)),
    ("unknown_tag", msgspec.msgpack.encode((b"get_all_your_blocks", 0, 0))),
    ("bad_shape", msgspec.msgpack.encode([GET_META_MSG, 0])),
    ("bad_shape", msgspec.msgpack.encode((GET_META_MSG, "0", "0"))),
    ("oversized", b"\x00" * (512 * 1024)),  # a huge frame, below the socket's hard limit
]


@pytest.fixture(scope="module")
def pair(shared_pair):
    """The shared LeaseKit pair (L = 6 s; its 12 s max hold is far above these tests' leases)."""
    return shared_pair


def listener_metrics(pair) -> tuple[float | None, float, Counter]:
    """(listener_up, handshake requests served, bad requests by reason) from P's /metrics."""
    text = httpx.get(f"{pair.prefill.url}/metrics", timeout=5).text
    up, served, bad = None, 0.0, Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == UP:
                up = s.value if up is None else min(up, s.value)
            elif s.name == SERVED:
                served += s.value
            elif s.name == BAD:
                bad[s.labels["reason"]] += s.value
    return up, served, bad


def wait_metrics(pair, predicate, timeout_s=60.0):
    """Poll P's /metrics until ``predicate(up, served, bad)``; P ships the listener's report at its
    next engine step, so a routed request is sent when nothing changed for a while."""
    deadline = time.monotonic() + timeout_s
    last_poke = time.monotonic()
    while True:
        got = listener_metrics(pair)
        if predicate(*got) or time.monotonic() > deadline:
            return got
        if time.monotonic() - last_poke > 5:
            poke = pair.router.generate(pair.prompt(), 2)
            assert poke.decode is not None and poke.decode.ok, poke
            last_poke = time.monotonic()
        time.sleep(0.5)


def assert_error_reply(reply):
    assert reply is not None, "a REQ peer must get a reply (the empty error reply), not hang"
    assert len(reply) == 2 and reply[0] == b"", reply
    assert isinstance(msgspec.msgpack.decode(reply[1]), float)


def raw_dealer(port, frames):
    """Send ``frames`` from a DEALER (no REQ envelope) and return whatever comes back within 0.5 s."""
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 500)
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        try:
            return sock.recv_multipart()
        except zmq.Again:
            return None


def leasekit_status(url, *extra):
    return subprocess.run([sys.executable, "-m", "leasekit.cli", "status", url, *extra],
                          capture_output=True, text=True, timeout=120)


def status_json(url) -> dict:
    """The one server entry of ``leasekit status URL -o json``."""
    done = leasekit_status(url, "-o", "json")
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 0 OK, 1 DEGRADED/CRITICAL
    (server,) = json.loads(done.stdout)["servers"]
    return server


MALFORMED_REASON = "malformed handshake request(s) refused"


def test_malformed_requests_are_refused_counted_and_survived(pair):
    port = pair.prefill.side_channel_port
    up0, served0, bad0 = wait_metrics(pair, lambda up, served, bad: up == 1 and served >= 1)
    assert up0 == 1 and served0 >= 1, "the warm-up D's handshake must have been served and reported"
    assert sum(bad0.values()) == 0  # nothing sent P a bad side-channel request yet (nor does the other module)
    before = status_json(pair.prefill.url)  # OK, or DEGRADED by the other module's expired leases
    assert before["counters"].get("handshake_bad_requests", 0) == 0, before
    assert not any(MALFORMED_REASON in r for r in before["reasons"]), before["reasons"]
    log_start = pair.prefill.log_path.stat().st_size
    for _reason, payload in MALFORMED:
        assert_error_reply(side_channel_request(HOST, port, payload, timeout_s=5))
    assert raw_dealer(port, [handshake_request()]) is None  # no REQ envelope: no reply, counted
    assert raw_dealer(port, [b"x", b"", b""]) is None
    assert raw_dealer(port, [b"", b"\x00" * (MAX_FRAME_BYTES + 4096)]) is None  # libzmq drops the peer
    expected = Counter(reason for reason, _ in MALFORMED) + Counter(bad_frames=2)
    assert MAX_REQUEST_BYTES < 512 * 1024 < MAX_FRAME_BYTES

    # P still accepts a new NIXL peer over the side channel ...
    with NixlPeer() as peer:
        assert peer.handshake(HOST, port)
    # ... and serves requests through the pair
    routed = pair.router.generate(pair.prompt(), 4)
    assert routed.prefill.ok and routed.decode is not None and routed.decode.ok, routed
    assert pair.prefill.healthy() and pair.decode.healthy()

    up, served, bad = wait_metrics(pair, lambda up, served, bad: bad == expected and served >= served0 + 1)
    assert up == 1
    assert bad == expected, f"bad requests on /metrics: {dict(bad)}, want {dict(expected)}"
    assert served >= served0 + 1  # the peer's handshake
    with pair.prefill.log_path.open("rb") as log:  # written by this test's requests
        log.seek(log_start)
        assert b"refused a bad NIXL handshake request" in log.read()

    done = leasekit_status(pair.prefill.url, "-o", "json")
    assert done.returncode == 1, done.stdout + done.stderr  # DEGRADED: bad requests were refused
    (server,) = json.loads(done.stdout)["servers"]
    assert server["listener"] == {"up": 1, "down_engines": []}, server
    assert server["counters"]["handshake_bad_requests"] == sum(expected.values())
    assert server["breakdown"]["handshake_bad_requests_by_reason"] == dict(sorted(expected.items()))
    assert server["verdict"] == "DEGRADED"
    assert any(MALFORMED_REASON in r for r in server["reasons"]), server["reasons"]
    # the refused requests are the only new finding (alone they make an OK P DEGRADED)
    new = [r for r in server["reasons"] if r not in before["reasons"]]
    assert new and all(MALFORMED_REASON in r for r in new), (before["reasons"], server["reasons"])
    assert not any("handshake listener down" in r for r in server["reasons"])
    table = leasekit_status(pair.prefill.url).stdout
    (row,) = [line for line in table.splitlines() if "handshake listener" in line]
    assert "up" in row.split("handshake listener", 1)[1] and "DOWN" not in row, table
    assert "bad handshake requests" in table and "unknown_rank=2" in table, table


def test_a_new_d_engine_connects_while_bad_requests_keep_coming(pair):
    port = pair.prefill.side_channel_port
    _, served0, bad0 = listener_metrics(pair)
    stop = threading.Event()
    sent = Counter()

    def flood():
        while not stop.is_set():
            for reason, payload in MALFORMED[:3]:
                if side_channel_request(HOST, port, payload, timeout_s=5) is not None:
                    sent[reason] += 1
            time.sleep(0.05)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        # a brand-new D engine (new engine id, new NIXL agent): its warm-up request is its first
        # P->D transfer, so it must handshake with P while the bad requests keep arriving
        new_d = pair.restart_decode()
        routed = pair.router.generate(pair.prompt(), 4)
        assert routed.decode is not None and routed.decode.ok, routed
        assert new_d.healthy() and pair.prefill.healthy()
    finally:
        stop.set()
        flooder.join(30)
    assert sum(sent.values()) > 0
    up, served, bad = wait_metrics(
        pair, lambda up, served, bad: served >= served0 + 1 and bad - bad0 == sent)
    assert up == 1
    assert served >= served0 + 1, "the new D's handshake must have been answered"
    assert bad - bad0 == sent, f"counted {dict(bad - bad0)}, sent {dict(sent)}"
