"""The side-channel handshake listener (leasekit.vllm.prefill.listener) on real ZMQ sockets in a thread:
good requests answered as vLLM answers them, every kind of bad request refused, counted and
survived, stop_event honoured, a failed bind retried. Plus the stock listener's defect, and the
listener health on its way to /metrics (ListenerStatsReporter -> LeaseKitPromMetrics)."""

import functools
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from leasekit.chaos.peer import handshake_request, side_channel_request
from leasekit.lease import LeaseTiming
from leasekit.telemetry import metrics as m
from leasekit.vllm.prefill import listener as lst

SERVED = {(0, 0): b"META-0", (0, 1): b"META-1"}
HOST = "127.0.0.1"


def free_port():
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Running:
    """serve_handshakes in a daemon thread on a free port; stop() sets stop_event and joins."""

    def __init__(self, port=None, **kwargs):
        kwargs.setdefault("recv_timeout_ms", 100)
        self.port = port or free_port()
        self.health = lst.ListenerHealth()
        self.ready, self.stop_event = threading.Event(), threading.Event()
        self.thread = threading.Thread(
            target=lst.serve_handshakes,
            args=(SERVED, self.ready, self.stop_event, f"tcp://{HOST}:{self.port}", self.health),
            kwargs=kwargs, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def request(self, payload, timeout_s=2.0):
        return side_channel_request(HOST, self.port, payload, timeout_s=timeout_s)

    def stop(self):
        self.stop_event.set()
        self.thread.join(5)


@pytest.fixture
def listener():
    running = Running()
    yield running
    running.stop()


def assert_served(reply, meta=b"META-0"):
    assert reply is not None and len(reply) == 2, reply  # vLLM's D asserts 2 frames
    assert reply[0] == meta
    assert isinstance(msgspec.msgpack.decode(reply[1]), float)  # P's perf_counter for the clock offset


def assert_error_reply(reply):
    assert reply is not None and len(reply) == 2 and reply[0] == b"", reply
    assert isinstance(msgspec.msgpack.decode(reply[1]), float)


def wait_for(predicate, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_good_request_is_answered_with_the_rank_metadata_and_a_timestamp(listener):
    assert_served(listener.request(handshake_request(0, 0)))
    assert_served(listener.request(handshake_request(0, 1)), b"META-1")
    assert listener.health.served == 2 and listener.health.alive
    assert sum(listener.health.bad.values()) == 0 and listener.health.last_bad_reason is None


BAD_REQ_PAYLOADS = [
    ("bad_msgpack", b"\xc1"),  # 0xc1 is never used in msgpack
    ("bad_msgpack", b"\x93\xa1"),  # truncated
    ("bad_shape", msgspec.msgpack.encode([1, 2])),
    ("bad_shape", msgspec.msgpack.encode({"a": 1})),
    ("bad_shape", msgspec.msgpack.encode((lst.GET_META_MSG, "0", 0))),
    ("bad_shape", msgspec.msgpack.encode((lst.GET_META_MSG, True, False))),  # bools are not ranks
    ("bad_shape", msgspec.msgpack.encode((lst.GET_META_MSG, 0.0, 0))),
    ("unknown_tag", msgspec.msgpack.encode((b"get_everything", 0, 0))),
    ("unknown_tag", msgspec.msgpack.encode(("get_meta_msg", 0, 0))),  # str, not bytes
    ("unknown_rank", handshake_request(0, 99)),
    ("unknown_rank", handshake_request(1, 0)),
    ("unknown_rank", handshake_request(-1, 0)),
    ("oversized", b"\x00" * (lst.MAX_REQUEST_BYTES + 1)),
    ("oversized", handshake_request(0, 0) + b"\x00" * lst.MAX_REQUEST_BYTES),
]


@pytest.mark.parametrize("reason, payload", BAD_REQ_PAYLOADS)
def test_bad_request_from_a_req_peer_gets_an_error_reply_is_counted_and_survived(listener, reason, payload):
    assert_error_reply(listener.request(payload))
    assert listener.health.bad[reason] == 1 and listener.health.last_bad_reason == reason
    assert sum(listener.health.bad.values()) == 1
    assert_served(listener.request(handshake_request()))
    assert listener.thread.is_alive() and listener.health.alive and listener.health.served == 1


def test_every_bad_kind_in_a_row_then_a_good_one(listener):
    for _reason, payload in BAD_REQ_PAYLOADS:
        assert_error_reply(listener.request(payload))
    want = {}
    for reason, _ in BAD_REQ_PAYLOADS:
        want[reason] = want.get(reason, 0) + 1
    assert {k: v for k, v in listener.health.bad.items() if v} == want
    assert_served(listener.request(handshake_request()))


def test_extra_frames_from_a_req_peer_are_refused_with_an_error_reply(listener):
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{listener.port}")
        sock.send_multipart([handshake_request(), b"extra"])
        assert_error_reply(sock.recv_multipart())
    assert listener.health.bad["bad_frames"] == 1
    assert_served(listener.request(handshake_request()))


@pytest.mark.parametrize("frames", [[handshake_request()], [b"x", handshake_request()], [b"x", b"", b""]])
def test_non_req_envelopes_get_no_reply_are_counted_and_survived(listener, frames):
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 300)
        sock.connect(f"tcp://{HOST}:{listener.port}")
        sock.send_multipart(frames)
        with pytest.raises(zmq.Again):
            sock.recv_multipart()
    assert listener.health.bad["bad_frames"] == 1
    assert_served(listener.request(handshake_request()))


def test_a_frame_over_the_socket_limit_disconnects_the_peer_and_is_not_buffered(listener):
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{listener.port}")
        sock.send_multipart([b"", b"\x00" * (lst.MAX_FRAME_BYTES + 1)])
        time.sleep(0.3)
    assert_served(listener.request(handshake_request()))
    assert sum(listener.health.bad.values()) == 0  # libzmq dropped it: never reached the listener


def test_an_internal_error_is_counted_and_the_listener_keeps_answering(listener, monkeypatch):
    real = lst.check_request
    calls = []

    def failing_once(frames, served):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("bug")
        return real(frames, served)

    monkeypatch.setattr(lst, "check_request", failing_once)
    assert listener.request(handshake_request(), timeout_s=0.5) is None  # dropped, no reply
    assert listener.health.bad["internal_error"] == 1 and listener.health.last_error == "RuntimeError: bug"
    assert_served(listener.request(handshake_request()))


def test_stop_event_stops_the_thread_within_the_receive_timeout():
    listener = Running(recv_timeout_ms=lst.RECV_TIMEOUT_MS)  # vLLM's 1 s
    assert_served(listener.request(handshake_request()))
    start = time.monotonic()
    listener.stop()
    assert not listener.thread.is_alive()
    assert time.monotonic() - start < lst.RECV_TIMEOUT_MS / 1000 + 1.0
    assert listener.health.alive is False


def test_stop_event_is_honoured_under_a_steady_stream_of_requests():
    running = Running()
    stop_sender = threading.Event()

    def flood():
        while not stop_sender.is_set():
            running.request(b"\xc1", timeout_s=0.2)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        assert wait_for(lambda: running.health.bad["bad_msgpack"] >= 5)
        running.stop()
        assert not running.thread.is_alive()
    finally:
        stop_sender.set()
        sender.join(5)


def test_a_failed_bind_does_not_hang_startup_and_is_retried():
    port = free_port()
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.ROUTER)
    squatter.bind(f"tcp://{HOST}:{port}")
    running = Running(port=port)  # ready_event is set although the bind failed
    try:
        assert not running.health.alive and running.health.socket_failures >= 1
        assert "ZMQError" in running.health.last_error
        squatter.close(linger=0)
        assert wait_for(lambda: running.health.alive, 5.0)
        assert_served(running.request(handshake_request()))
    finally:
        running.stop()
        ctx.destroy(linger=0)


def test_check_request_never_raises_and_labels_stay_in_the_catalog():
    import random

    rng = random.Random(7)
    for _ in range(2000):
        frames = [b"id"] + [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40)))
                            for _ in range(rng.randrange(0, 4))]
        checked = lst.check_request(frames, SERVED)
        assert checked.rank is None and checked.reason in m.HANDSHAKE_BAD_REASONS or checked.rank in SERVED


def test_health_refuses_an_unbounded_reason():
    health = lst.ListenerHealth()
    with pytest.raises(KeyError):
        health.record_bad("something new")
    assert set(health.snapshot()[2]) == set(m.HANDSHAKE_BAD_REASONS)


# -- against vLLM's own listener and D ------------------------------------------------------------
base_scheduler = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler", reason="needs vLLM (setup.sh)")


def _stock_listener(port):
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener,
                              args=(SERVED, ready, stop, HOST, port), daemon=True)
    thread.start()
    assert ready.wait(5)
    return thread, stop


def test_good_replies_match_vllm_stock_listener_frame_for_frame(listener):
    port = free_port()
    thread, stop = _stock_listener(port)
    try:
        stock = side_channel_request(HOST, port, handshake_request(0, 1), timeout_s=2)
        ours = listener.request(handshake_request(0, 1))
        assert len(stock) == len(ours) == 2 and stock[0] == ours[0] == b"META-1"
        assert type(msgspec.msgpack.decode(stock[1])) is type(msgspec.msgpack.decode(ours[1])) is float
    finally:
        stop.set()
        thread.join(3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the stock thread's KeyError
def test_stock_listener_dies_on_one_bad_request_ours_does_not(listener):
    """The defect this module fixes (vllm 0.32.0 nixl/base_scheduler.py), measured on the real code."""
    port = free_port()
    thread, stop = _stock_listener(port)
    try:
        assert side_channel_request(HOST, port, handshake_request(0, 99), timeout_s=1) is None
        thread.join(3)
        assert not thread.is_alive(), "stock listener thread survived an unknown rank"
        assert side_channel_request(HOST, port, handshake_request(0, 0), timeout_s=1) is None  # nobody answers
    finally:
        stop.set()
    assert_error_reply(listener.request(handshake_request(0, 99)))
    assert_served(listener.request(handshake_request(0, 0)))


def test_vllm_d_fails_fast_on_the_error_reply():
    """What vLLM's D (nixl/base_worker.py: _nixl_handshake) does with our error reply: the payload
    decode raises at once, which D turns into a failed handshake."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.Decoder(NixlHandshakePayload).decode(b"")


# -- health to /metrics ----------------------------------------------------------------------------
stats_mod = pytest.importorskip("leasekit.vllm.stats")


def _prom(registry):
    from prometheus_client import Counter, Gauge, Histogram

    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return stats_mod.LeaseKitPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                         {0: ["tiny", "0"]})


def _ship(stats):
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))
    return stats_mod.LeaseKitKVConnectorStats(data=wire)


def _entry(up, served, bad):
    stats = stats_mod.LeaseKitKVConnectorStats()
    stats.data[stats_mod.LISTENER].append([up, served, bad])
    return _ship(stats).data


def test_listener_health_reaches_prometheus_as_up_gauge_and_per_request_counters():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = _prom(registry)
    reporter = stats_mod.ListenerStatsReporter()
    health = lst.ListenerHealth()

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", "mode": "pull", **labels})

    health.alive = True
    first = reporter.report(*health.snapshot())
    assert first is not None and not first.is_empty()
    assert reporter.report(*health.snapshot()) is None  # nothing changed: nothing shipped
    prom.observe(_ship(first).data, 0)
    assert value("leasekit_kv_handshake_listener_up") == 1
    assert value("leasekit_kv_handshake_requests_total") == 0
    for reason in m.HANDSHAKE_BAD_REASONS:  # every series exists from the first report
        assert value("leasekit_kv_handshake_bad_requests_total", reason=reason) == 0
    health.served = 3
    health.record_bad("unknown_rank")
    health.record_bad("unknown_rank")
    health.record_bad("bad_msgpack")
    # a worker's stats in the same step: aggregated as vLLM's scheduler does
    worker = stats_mod.LeaseKitKVConnectorStats()
    stats_mod.LeaseStatsObserver(worker, 0).config("kv_producer", LeaseTiming.from_lease_duration(6))
    combined = worker.aggregate(reporter.report(*health.snapshot()))
    prom.observe(_ship(combined).data, 0)
    assert value("leasekit_kv_handshake_requests_total") == 3
    assert value("leasekit_kv_handshake_bad_requests_total", reason="unknown_rank") == 2
    assert value("leasekit_kv_handshake_bad_requests_total", reason="bad_msgpack") == 1
    assert value("leasekit_kv_handshake_listener_up") == 1  # the worker's zero series did not reset it
    health.alive = False
    prom.observe(_ship(reporter.report(*health.snapshot())).data, 0)
    assert value("leasekit_kv_handshake_listener_up") == 0
    assert value("leasekit_kv_handshake_requests_total") == 3  # totals, not re-added
    # an engine restart (totals went down) counts the new totals
    prom.observe(_entry(1, 1, {"bad_shape": 1}), 0)
    assert value("leasekit_kv_handshake_requests_total") == 4
    assert value("leasekit_kv_handshake_bad_requests_total", reason="bad_shape") == 1
    # an unknown reason from a newer peer never becomes a label
    prom.observe(_entry(1, 1, {"bad_shape": 1, "made_up": 5}), 0)
    assert registry.get_sample_value("leasekit_kv_handshake_bad_requests_total",
                                     {"model_name": "tiny", "engine": "0", "mode": "pull", "reason": "made_up"}) is None
