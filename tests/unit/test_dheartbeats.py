"""D's heartbeat component (leasekit/vllm/decode/heartbeats.py) behind the worker's ``_send_heartbeats`` hook
(decode/hooks.py): counting each heartbeat notification, the heartbeat spans' tracking, and the chaos
fault points of the send path (driven through their real control file)."""

import logging
import time
from types import SimpleNamespace

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.telemetry import semconv as sc
from leasekit.telemetry.decode_spans import HeartbeatSpanRecorder
from leasekit.vllm.decode.heartbeats import DHeartbeatSender
from leasekit.vllm.decode.hooks import DHooks
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.faultpoints import FaultPoints, read_state, write_control
from leasekit.vllm.stats import HEARTBEATS, LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.taps import TelemetryErrors


class StockD:
    """vLLM's D worker as the heartbeat component sees it: the P agents it knows and ``_send_heartbeats``,
    which records the engines of each batch it sends."""

    tp_rank = 0

    def __init__(self):
        self._remote_agents = {"P-engine": {(0, 0): "p0"}}
        self.batches: list[list[str]] = []

    def _send_heartbeats(self, metadata):
        self.batches.append(sorted(metadata.heartbeat_by_engine))


class HookedD(DHooks, StockD):
    """D's hooks over the stand-in; the read gate is a recorder of the engines it is asked to greet."""

    _lk_ready = True


class Warnings:
    def __init__(self):
        self.messages = []

    def warn(self, msg, *args, **fields):
        self.messages.append((msg % args, fields))


def make_d(faults=None):
    worker = HookedD()
    stats = LeaseKitKVConnectorStats()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = HeartbeatSpanRecorder(provider.get_tracer("t"), engine_id="d", tp_rank=0, kv_role="kv_consumer")
    warnings = Warnings()
    worker.greeted = []
    worker._lk_gate = SimpleNamespace(hello_engines=lambda by_engine: worker.greeted.append(sorted(by_engine)))
    worker._lk_dbeats = DHeartbeatSender(
        VllmDState(worker), spans=spans, stats=LeaseStatsObserver(stats, 0),
        errors=TelemetryErrors(logging.getLogger("t")), faults=faults or FaultPoints(None), extension_s=2.5,
        warning=warnings,
    )
    return SimpleNamespace(worker=worker, beats=worker._lk_dbeats, stats=stats, spans=spans, exporter=exporter,
                           warnings=warnings)


def batch(*req_ids, engine="P-engine"):
    return SimpleNamespace(heartbeat_by_engine={engine: SimpleNamespace(req_ids=set(req_ids))})


def test_each_heartbeat_is_counted_per_p_engine_and_on_its_request_spans():
    d = make_d()
    d.beats.track([("P1", "P-engine", "d1", None)], None)
    d.beats.sent("p0", b"HB:P1,P2", True)
    d.beats.sent("stranger", b"HB:P1", True)
    assert d.stats.data[HEARTBEATS] == [[0, "P-engine", 1], [0, "unknown", 1]]
    d.beats.track(None, ["P1"])
    (span,) = d.exporter.get_finished_spans()
    assert span.attributes[sc.DECODE_REQUEST_ID] == "d1" and d.spans.tracked == 0
    assert [event.name for event in span.events].count(sc.EVENT_FIRST_HEARTBEAT) == 1


def test_a_failed_heartbeat_is_counted_and_warned_naming_e():
    d = make_d()
    d.beats.sent("p0", b"HB:P1", False)
    assert d.stats.data[HEARTBEATS] == [[0, "P-engine", 0]]
    ((message, fields),) = d.warnings.messages
    assert "E=2.5 s" in message and fields["event"] == "heartbeat_send_failure"
    assert fields["remote_engine_id"] == "P-engine"


def test_the_hook_greets_protocol_engines_then_sends_stock():
    d = make_d()
    d.worker._send_heartbeats(batch("P1"))
    assert d.worker.greeted == [["P-engine"]] and d.worker.batches == [["P-engine"]]


def test_chaos_fault_points_drop_delay_and_duplicate_batches_in_the_send_path(tmp_path):
    path = str(tmp_path / "decode.json")
    write_control(path, {"heartbeats": {"drop_next": 1, "delay_next_s": 0.001, "duplicate": 2}})
    d = make_d(FaultPoints(path))
    d.beats._faults.poll()
    d.worker._send_heartbeats(batch("P1"))  # dropped
    assert d.worker.batches == []
    d.worker._send_heartbeats(batch("P2", engine="Q-engine"))  # delayed by 1 ms: goes out with a later step
    assert d.worker.batches == []
    time.sleep(0.01)
    d.worker._send_heartbeats(batch("P3"))  # the delayed one first, then this one twice
    assert d.worker.batches == [["Q-engine"], ["P-engine"], ["P-engine"]]
    state = read_state(path, 0)
    assert state["delayed"] == 1 and state["duplicated"] == 1 and len(state["dropped"]) == 1


def test_a_worker_whose_leasekit_part_never_ran_sends_stock():
    worker = type("Bare", (DHooks, StockD), {"_lk_ready": False})()
    worker._send_heartbeats(batch("P1"))
    assert worker.batches == [["P-engine"]]


def test_longest_silence_covers_the_gap_before_the_first_heartbeat_between_them_and_the_open_one():
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rec = HeartbeatSpanRecorder(provider.get_tracer("t"), engine_id="d", tp_rank=0)
    assert rec.longest_silence_s("d-1", now=0.0) is None  # not tracked
    rec.track("p-1", remote_engine_id="P", decode_request_id="d-1", now=10.0)
    assert rec.longest_silence_s("d-1", now=10.5) == 0.5  # open since tracking, nothing sent yet
    rec.sent(["p-1"], now=11.0)
    rec.sent(["p-1"], now=19.0)  # D frozen 8 s in between
    rec.sent(["p-1"], now=20.0)
    assert rec.longest_silence_s("d-1", now=20.5) == 8.0
    assert rec.longest_silence_s("d-1", now=40.0) == 20.0  # the open interval counts too
    assert rec.longest_silence_s("p-1", now=20.5) is None  # keyed by D's id, not P's
    assert rec.note("d-1", "registration_withheld", {"leasekit.silence_s": 8.0})
    rec.untrack("p-1", now=41.0)
    assert rec.longest_silence_s("d-1", now=42.0) is None and not rec.note("d-1", "x", {})
    (span,) = exporter.get_finished_spans()
    assert [e.name for e in span.events if e.name == "registration_withheld"] == ["registration_withheld"]
