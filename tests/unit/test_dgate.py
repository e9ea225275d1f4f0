"""D's read gate inside the worker hook (leasekit/vllm/decode/gate.py), over a stand-in for vLLM's stock
``_pop_done_transfers``: what D reports to vLLM for each gate outcome, and when D says hello again.
The wire and the real pair are covered by tests/integration/test_fail_closed.py."""

import time
from types import SimpleNamespace

import pytest

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.lease.codec import decode_notification, split_protocol_ids
from leasekit.lease.readgate import OUTCOME_TIMEOUT, OUTCOME_VERIFIED, GateResult
from leasekit.vllm.decode.gate import DReadGating
from leasekit.vllm.stats import READS, LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.verdictchan import decode_hello_payload
from tests.unit.test_p_notifications import Worker


class StockPolling:
    """vLLM's ``_pop_done_transfers`` (the reads NIXL finished since the last poll, none failed) and
    ``_read_blocks`` (records the read it posts)."""

    def _pop_done_transfers(self, transfers):
        finished, self.finished = set(self.finished), set()
        return finished, set()

    def _read_blocks(self, **kwargs):
        self.posted.append(kwargs["request_id"])
        return True


class Wire:
    """The NIXL wrapper as D's worker holds it: ``send_notif`` (the tapped path, heartbeats) and
    ``_wrapped.send_notif`` (raw, the hello); both record ``(agent, bytes)`` in one list, in order."""

    def __init__(self):
        self.sent = []
        self._wrapped = SimpleNamespace(send_notif=lambda agent, notif_msg: self.sent.append((agent, notif_msg)))

    def send_notif(self, agent, notif_msg):
        self.sent.append((agent, notif_msg))


class D(DReadGating, StockPolling):
    def __init__(self):
        self.finished: set[str] = set()
        self._recving_transfers: dict = {}
        self._recv_failures: set[str] = set()
        self._recving_metadata = {}
        self._lk_faults = SimpleNamespace(enabled=False)
        self._lk_errors = SimpleNamespace(report=lambda where, exc: (_ for _ in ()).throw(exc))
        self._lk_hb = SimpleNamespace(context_of=lambda rid: None)
        self.stats = LeaseKitKVConnectorStats()
        self._lk_stats = LeaseStatsObserver(self.stats, 0)
        self.tp_rank = 0
        self.notified: list[str] = []
        self.posted: list[str] = []
        self.nixl_wrapper = Wire()
        self._remote_agents = {"P-engine": {(0, 0): "p0"}}
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self._lk_init_gate(6.0, 6.0, provider.get_tracer("t"))
        self.drops: list[str] = []

    def _lk_drop(self, reason, agent, detail):
        self.drops.append(reason)

    def _send_pending_recv_notifs(self, request_id):
        self.notified.append(request_id)

    def poll(self):
        return self._pop_done_transfers(self._recving_transfers)

    def outcomes(self):
        return [entry[1] for entry in self.stats.data[READS]]


def protected_read(d: D, request_id="d1", agent="p0", remote="P1"):
    d._lk_gate.protect(request_id)
    d._lk_gate.expect(request_id, agent, remote)


def test_a_request_aborted_while_its_read_is_held_is_reported_done_so_vllm_frees_its_blocks():
    d = D()
    protected_read(d)
    d.finished = {"d1"}
    assert d.poll() == (set(), set())  # held for P's verdict
    assert d.notified == ["d1"]
    d._lk_finished(["d1"])  # the client aborted it on D
    assert d.poll() == ({"d1"}, set())  # vLLM frees a WAITING_FOR_REMOTE_KVS request's blocks only now
    assert d.outcomes() == ["abandoned"]
    (span,) = d.exporter.get_finished_spans()
    assert span.attributes["leasekit.read_outcome"] == "abandoned"


def test_a_protected_read_finishing_after_its_request_ended_is_abandoned_not_unprotected():
    d = D()
    protected_read(d)
    d._lk_finished(["d1"])
    d.finished = {"d1"}
    assert d.poll() == ({"d1"}, set())
    d.finished = {"d2"}  # a stock P's read: never protected
    assert d.poll() == ({"d2"}, set())
    assert d.outcomes() == ["abandoned", "unprotected"]


def test_d_says_hello_again_after_a_read_from_that_agent_timed_out():
    d = D()
    d._lk_hello_sent |= {"p0", "p1"}
    d._lk_record_read(GateResult("d1", "P1", OUTCOME_VERIFIED, 0.01, ("p1",)), now=1.0)
    assert d._lk_hello_sent == {"p0", "p1"}
    d._lk_record_read(GateResult("d2", "P2", OUTCOME_TIMEOUT, 6.0, ("p0",)), now=7.0)
    assert d._lk_hello_sent == {"p1"}  # P may have unloaded our agent (cap, restart): the next read re-hellos


def read(d: D, request_id="d1", remote="P1"):
    return d._read_blocks(request_id=request_id, remote_request_id=remote, dst_engine_id="P-engine",
                          read_spec=SimpleNamespace(remote_rank=0))


def test_a_protected_read_is_preceded_by_the_hello_and_a_heartbeat_probe_for_its_lease():
    d = D()
    d._lk_protect([["d1", "P-engine", "127.0.0.1"]])
    assert read(d) and d.posted == ["d1"]
    (agent, hello), probe = d.nixl_wrapper.sent
    assert agent == "p0" and probe == ("p0", b"HB:P1")  # then the read
    _seq, payload, _ = split_protocol_ids(decode_notification(hello).req_ids)
    endpoint, token = decode_hello_payload(payload)
    assert endpoint in d._lk_inbox.endpoints and endpoint.startswith("tcp://127.0.0.1:") and token == d._lk_inbox.token
    assert d._lk_gate._owner == {("p0", "P1"): "d1"}  # P0's verdict (or the probe's ack) decides it
    read(d, request_id="d2", remote="P2")  # a stock P's request: no hello, no probe
    assert d.nixl_wrapper.sent[2:] == [] and d.posted == ["d1", "d2"]
    d._lk_close_gate()


def test_no_probe_while_a_chaos_heartbeat_fault_is_set():
    d = D()
    d._lk_faults = SimpleNamespace(enabled=True, heartbeats_disturbed=lambda: True)
    d._lk_protect([["d1", "P-engine", "127.0.0.1"]])
    read(d)
    assert [msg[:9] for _agent, msg in d.nixl_wrapper.sent] == [b"HB:LK1~H~"]  # the hello only
    d._lk_close_gate()


def test_a_read_of_an_engine_whose_host_d_does_not_know_is_ungated():
    """Fail closed: with no way to hear P, the read is discarded (vLLM recomputes), never served."""
    d = D()
    d._lk_errors = SimpleNamespace(report=lambda where, exc: None)
    d._lk_protect([["d1", "P-engine"]])  # an older scheduler's metadata: no host
    read(d)
    d.finished = {"d1"}
    assert d.poll() == (set(), {"d1"}) and d.outcomes() == ["ungated"]


def wait_for_decision(d: D, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed = d.poll()
        if done or failed:
            return done, failed
        time.sleep(0.005)
    return set(), set()


@pytest.mark.parametrize("live", [True, False])
def test_p_verdict_reaches_d_over_zmq_and_decides_the_held_read(live):
    """Both mixins over a real loopback ZMQ channel: D's hello (a NIXL heartbeat id) tells P where to
    answer; P's verdict on D's completion releases (live lease) or discards (reaped) the held read."""
    d = D()
    p = Worker()
    p.nixl_wrapper.name = "p0"
    try:
        d._lk_protect([["d1", "P-engine", "127.0.0.1"]])
        read(d)
        hello = d.nixl_wrapper.sent[0][1]
        if live:
            p.grant("P1", time.perf_counter())
        p.step({"d-agent": [hello, b"P1:1"]})
        d.finished = {"d1"}
        assert wait_for_decision(d) == (({"d1"}, set()) if live else (set(), {"d1"}))
        assert d.outcomes() == ["verified" if live else "reaped"] and d.drops == []
    finally:
        p._lk_close_notifications()
        d._lk_close_gate()


def test_junk_in_the_verdict_inbox_is_dropped_and_counted():
    import zmq

    d = D()
    endpoint = d._lk_inbox.endpoint_for("127.0.0.1")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    token = d._lk_inbox.token.encode()
    push.send(b"one frame")
    push.send_multipart([b"p0", token, b"HB:P1"])  # a heartbeat is not a P -> D message
    push.send_multipart([b"\xff", token, b"LK1:V:ok:P1"])
    push.send_multipart([b"p0", b"0" * 16, b"LK1:V:ok:P1"])  # not this inbox's token
    deadline = time.monotonic() + 5.0
    while len(d.drops) < 4 and time.monotonic() < deadline:
        d.poll()
        time.sleep(0.005)
    assert d.drops == ["bad_protocol"] * 4
    push.close(linger=0)
    ctx.term()
    d._lk_close_gate()
