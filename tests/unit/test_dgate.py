"""D's read gate component (leasekit/vllm/decode/gate.py) behind the worker's hooks (decode/hooks.py), over
a stand-in for vLLM's stock ``_pop_done_transfers`` and ``_read_blocks``: what D reports to vLLM for each
gate outcome, and when D says hello again. The wire and the real pair are covered by
tests/integration/test_fail_closed.py."""

import time
from types import SimpleNamespace

import pytest

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.lease.codec import decode_notification, split_protocol_ids
from leasekit.lease.readgate import OUTCOME_TIMEOUT, OUTCOME_VERIFIED, GateResult
from leasekit.vllm.decode.gate import DReadGate
from leasekit.vllm.decode.hooks import DHooks
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.stats import READS, LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.verdictchan import decode_hello_payload
from tests.unit.test_p_notifications import Worker


class Wire:
    """The NIXL wrapper as D's worker holds it: ``send_notif`` (the tapped path, heartbeats) and
    ``_wrapped.send_notif`` (raw, the hello); both record ``(agent, bytes)`` in one list, in order."""

    def __init__(self):
        self.sent = []
        self._wrapped = SimpleNamespace(send_notif=lambda agent, notif_msg: self.sent.append((agent, notif_msg)))

    def send_notif(self, agent, notif_msg):
        self.sent.append((agent, notif_msg))


class StockD:
    """vLLM's D worker as the gate sees it (through :class:`VllmDState`): ``_pop_done_transfers`` returns
    the reads NIXL finished since the last poll (none failed), ``_read_blocks`` records the read it posts,
    ``_send_pending_recv_notifs`` records the request it notifies P for."""

    def __init__(self):
        self.tp_rank = 0
        self._remote_agents = {"P-engine": {(0, 0): "p0"}}
        self._recving_transfers: dict = {}
        self._recving_metadata: dict = {}
        self._recv_failures: set[str] = set()
        self.nixl_wrapper = Wire()
        self.finished: set[str] = set()
        self.notified: list[str] = []
        self.posted: list[str] = []

    def _pop_done_transfers(self, transfers):
        finished, self.finished = set(self.finished), set()
        return finished, set()

    def _read_blocks(self, **kwargs):
        self.posted.append(kwargs["request_id"])
        return True

    def _send_pending_recv_notifs(self, request_id):
        self.notified.append(request_id)


class HookedD(DHooks, StockD):
    """D's hooks over the stand-in, with the gate component the test builds (``_lk_gate``)."""

    _lk_ready = True


class Raise:
    """``errors`` that re-raises, so that a test sees any failure the gate would only have logged."""

    def report(self, where, exc):
        raise exc


def make_d(faults=None, errors=None, timeout_s=6.0):
    """A hooked D worker and its gate: returns ``(worker, gate, stats, exporter, drops)``."""
    worker = HookedD()
    stats = LeaseKitKVConnectorStats()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    drops: list[str] = []
    worker._lk_gate = DReadGate(
        VllmDState(worker), timeout_s=timeout_s, lease_duration_s=6.0, tracer=provider.get_tracer("t"),
        stats=LeaseStatsObserver(stats, 0), errors=errors or Raise(), faults=faults or SimpleNamespace(enabled=False),
        drop=lambda reason, agent, detail: drops.append(reason), context_of=lambda remote_request_id: None,
    )
    return SimpleNamespace(worker=worker, gate=worker._lk_gate, stats=stats, exporter=exporter, drops=drops)


def poll(d):
    return d.worker._pop_done_transfers(d.worker._recving_transfers)


def outcomes(d):
    return [entry[1] for entry in d.stats.data[READS]]


def protected_read(d, request_id="d1", agent="p0", remote="P1"):
    d.gate.gate.protect(request_id)
    d.gate.gate.expect(request_id, agent, remote)


def test_a_request_aborted_while_its_read_is_held_is_reported_done_so_vllm_frees_its_blocks():
    d = make_d()
    protected_read(d)
    d.worker.finished = {"d1"}
    assert poll(d) == (set(), set())  # held for P's verdict
    assert d.worker.notified == ["d1"]
    d.gate.finish(["d1"])  # the client aborted it on D
    assert poll(d) == ({"d1"}, set())  # vLLM frees a WAITING_FOR_REMOTE_KVS request's blocks only now
    assert outcomes(d) == ["abandoned"]
    (span,) = d.exporter.get_finished_spans()
    assert span.attributes["leasekit.read_outcome"] == "abandoned"


def test_a_protected_read_finishing_after_its_request_ended_is_abandoned_not_unprotected():
    d = make_d()
    protected_read(d)
    d.gate.finish(["d1"])
    d.worker.finished = {"d1"}
    assert poll(d) == ({"d1"}, set())
    d.worker.finished = {"d2"}  # a stock P's read: never protected
    assert poll(d) == ({"d2"}, set())
    assert outcomes(d) == ["abandoned", "unprotected"]


def test_polls_of_other_transfer_maps_are_left_to_vllm():
    """``_pop_done_transfers`` also polls sends; only the receive map (``_recving_transfers``) is gated."""
    d = make_d()
    protected_read(d)
    d.worker.finished = {"d1"}
    assert d.worker._pop_done_transfers({}) == ({"d1"}, set()) and d.worker.notified == []


def test_d_says_hello_again_after_a_read_from_that_agent_timed_out():
    d = make_d()
    d.gate.hello_sent |= {"p0", "p1"}
    d.gate._record_read(GateResult("d1", "P1", OUTCOME_VERIFIED, 0.01, ("p1",)), now=1.0)
    assert d.gate.hello_sent == {"p0", "p1"}
    d.gate._record_read(GateResult("d2", "P2", OUTCOME_TIMEOUT, 6.0, ("p0",)), now=7.0)
    assert d.gate.hello_sent == {"p1"}  # P may have unloaded our agent (cap, restart): the next read re-hellos


def test_after_a_timed_out_read_the_next_read_says_hello_again_on_the_wire():
    d = make_d(timeout_s=0.05)
    d.gate.protect([["d1", "P-engine", "127.0.0.1"], ["d2", "P-engine", "127.0.0.1"]])
    read(d)
    d.worker.finished = {"d1"}
    assert poll(d) == (set(), set())
    time.sleep(0.1)
    assert poll(d) == (set(), {"d1"}) and outcomes(d) == ["timeout"]
    read(d, request_id="d2", remote="P2")
    hellos = [msg for _agent, msg in d.worker.nixl_wrapper.sent if msg.startswith(b"HB:LK1~H~")]
    assert len(hellos) == 2
    d.gate.close()


def read(d, request_id="d1", remote="P1"):
    return d.worker._read_blocks(request_id=request_id, remote_request_id=remote, dst_engine_id="P-engine",
                                 read_spec=SimpleNamespace(remote_rank=0))


def test_a_protected_read_is_preceded_by_the_hello_and_a_heartbeat_probe_for_its_lease():
    d = make_d()
    d.gate.protect([["d1", "P-engine", "127.0.0.1"]])
    assert read(d) and d.worker.posted == ["d1"]
    (agent, hello), probe = d.worker.nixl_wrapper.sent
    assert agent == "p0" and probe == ("p0", b"HB:P1")  # then the read
    _seq, payload, _ = split_protocol_ids(decode_notification(hello).req_ids)
    hello = decode_hello_payload(payload)
    endpoint, token = hello.endpoint, hello.token
    assert hello.req_id is None and hello.tag is None  # a marking without a lease secret: the old hello
    assert endpoint in d.gate.inbox.endpoints and endpoint.startswith("tcp://127.0.0.1:") and token == d.gate.inbox.token
    assert d.gate.gate._owner == {("p0", "P1"): "d1"}  # P0's verdict (or the probe's ack) decides it
    read(d, request_id="d2", remote="P2")  # a stock P's request: no hello, no probe
    assert d.worker.nixl_wrapper.sent[2:] == [] and d.worker.posted == ["d1", "d2"]
    d.gate.close()


def test_no_probe_while_a_chaos_heartbeat_fault_is_set():
    d = make_d(faults=SimpleNamespace(enabled=True, heartbeats_disturbed=lambda: True))
    d.gate.protect([["d1", "P-engine", "127.0.0.1"]])
    read(d)
    assert [msg[:9] for _agent, msg in d.worker.nixl_wrapper.sent] == [b"HB:LK1~H~"]  # the hello only
    d.gate.close()


def test_a_read_of_an_engine_whose_host_d_does_not_know_is_ungated():
    """Fail closed: with no way to hear P, the read is discarded (vLLM recomputes), never served."""
    d = make_d(errors=SimpleNamespace(report=lambda where, exc: None))
    d.gate.protect([["d1", "P-engine"]])  # an older scheduler's metadata: no host
    read(d)
    d.worker.finished = {"d1"}
    assert poll(d) == (set(), {"d1"}) and outcomes(d) == ["ungated"]


def test_a_worker_whose_leasekit_part_never_ran_is_stock():
    """``_lk_ready`` False (vLLM's own tests build workers without ``__init__``): the hooks are vLLM's."""
    worker = type("Bare", (DHooks, StockD), {"_lk_ready": False})()
    worker.finished = {"d1"}
    assert worker._pop_done_transfers(worker._recving_transfers) == ({"d1"}, set())
    assert worker._read_blocks(request_id="d1") and worker.posted == ["d1"]


def wait_for_decision(d, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed = poll(d)
        if done or failed:
            return done, failed
        time.sleep(0.005)
    return set(), set()


@pytest.mark.parametrize("live", [True, False])
def test_p_verdict_reaches_d_over_zmq_and_decides_the_held_read(live):
    """Both sides' components over a real loopback ZMQ channel: D's hello (a NIXL heartbeat id) tells P where
    to answer; P's verdict on D's completion releases (live lease) or discards (reaped) the held read."""
    d = make_d()
    p = Worker(agent="p0")
    try:
        d.gate.protect([["d1", "P-engine", "127.0.0.1"]])
        read(d)
        hello = d.worker.nixl_wrapper.sent[0][1]
        if live:
            p.grant("P1", time.perf_counter())
        p.step({"d-agent": [hello, b"P1:1"]})
        d.worker.finished = {"d1"}
        assert wait_for_decision(d) == (({"d1"}, set()) if live else (set(), {"d1"}))
        assert outcomes(d) == ["verified" if live else "reaped"] and d.drops == []
    finally:
        p.replies.close()
        d.gate.close()


def test_junk_in_the_verdict_inbox_is_dropped_and_counted():
    import zmq

    d = make_d()
    endpoint = d.gate.inbox.endpoint_for("127.0.0.1")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    token = d.gate.inbox.token.encode()
    push.send(b"one frame")
    push.send_multipart([b"p0", token, b"HB:P1"])  # a heartbeat is not a P -> D message
    push.send_multipart([b"\xff", token, b"LK1:V:ok:P1"])
    push.send_multipart([b"p0", b"0" * 16, b"LK1:V:ok:P1"])  # not this inbox's token
    deadline = time.monotonic() + 5.0
    while len(d.drops) < 4 and time.monotonic() < deadline:
        poll(d)
        time.sleep(0.005)
    assert d.drops == ["bad_protocol"] * 4
    push.close(linger=0)
    ctx.term()
    d.gate.close()


def test_the_p_engines_d_remembers_are_bounded(monkeypatch):
    """P engine ids come from request parameters (anyone who can send D a request names one): D keeps at
    most MAX_ENGINE_HOSTS of them, the most recent, as it does for their hosts."""
    import leasekit.vllm.decode.gate as gate_module

    monkeypatch.setattr(gate_module, "MAX_ENGINE_HOSTS", 3)
    d = make_d()
    d.gate.protect([[f"d{i}", f"P{i}", "10.0.0.1", None] for i in range(10)])
    assert list(d.gate._protocol_engines) == ["P7", "P8", "P9"] and list(d.gate._engine_hosts) == ["P7", "P8", "P9"]
    d.gate.protect([["d10", "P8", "10.0.0.2", None]])
    assert list(d.gate._protocol_engines) == ["P7", "P9", "P8"]
