"""Lease metrics end to end through vLLM's own classes: recorder -> observer -> KVConnectorStats ->
msgpack (as vLLM ships it to the API server) -> LeaseKitPromMetrics -> a real prometheus-client
registry. Also the structured log records and trace-context joining."""

import dataclasses
import functools
import json
import logging
from types import SimpleNamespace

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from leasekit.lease import LeaseTiming
from leasekit.telemetry import metrics as m
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.decode_spans import HeartbeatSpanRecorder
from leasekit.telemetry.lease_log import LeaseLogObserver, LogConfigError, RateLimitedWarning, lease_logger
from leasekit.telemetry.lease_spans import LeaseSpanRecorder

stats_mod = pytest.importorskip("leasekit.vllm.stats")  # needs vLLM (installed by setup.sh)

TIMING = LeaseTiming.from_lease_duration(6)  # H=1, E=4
LABELS = ["model_name", "engine"]


def _prom(registry):
    types = {
        Counter: functools.partial(Counter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    return stats_mod.LeaseKitPromMetrics(SimpleNamespace(kv_transfer_config=None), types, LABELS, {0: ["tiny", "0"]})


def _worker(rank, exporter=None, extra_observers=()):
    stats = stats_mod.LeaseKitKVConnectorStats()
    observer = stats_mod.LeaseStatsObserver(stats, rank)
    provider = TracerProvider()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    rec = LeaseSpanRecorder(provider.get_tracer("t"), engine_id="P0", tp_rank=rank, timing=TIMING,
                            observers=(observer, *extra_observers))
    return stats, observer, rec


def _shipped(*worker_stats):
    """What vLLM does: aggregate over TP workers, to_dict, msgpack to the API server, rebuild."""
    total = worker_stats[0].clone_and_reset()
    for s in worker_stats[1:]:
        total = total.aggregate(s.clone_and_reset())
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict()))
    return stats_mod.LeaseKitKVConnectorStats(data=wire)


def value(registry, name, **labels):
    v = registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", "mode": "pull", **labels})
    return 0.0 if v is None else v


def test_lease_events_reach_prometheus_with_units_and_labels():
    registry = CollectorRegistry()
    prom = _prom(registry)
    s0, o0, r0 = _worker(0)
    s1, o1, r1 = _worker(1)
    o0.config("kv_producer", TIMING)
    for rec in (r0, r1):
        rec.grant("A", 106.0, kv_blocks=3, now=100.0)
        rec.grant("B", 106.0, kv_blocks=5, now=100.0)
    o0.state(r0.expiring_within(1.0, now=100.0))
    o1.state(r1.expiring_within(1.0, now=100.0))
    shipped = _shipped(s0, s1)
    assert not shipped.is_empty()
    prom.observe(shipped.data, 0)
    assert value(registry, "leasekit_kv_lease_grants_total", tp_rank="0") == 2
    assert value(registry, "leasekit_kv_lease_grants_total", tp_rank="1") == 2
    assert value(registry, "leasekit_kv_leases_active", tp_rank="0") == 2
    assert value(registry, "leasekit_kv_lease_pinned_blocks", tp_rank="1") == 8
    assert value(registry, "leasekit_kv_lease_duration_seconds", kv_role="kv_producer") == 6
    assert value(registry, "leasekit_kv_lease_extension_seconds", kv_role="kv_producer") == 4
    # rank 0 announced its config: every P-side series exists at zero before its first event
    # ("avoid missing metrics"); D-side series do not exist on a producer
    zero = {"model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": "0"}
    assert registry.get_sample_value("leasekit_kv_lease_late_completions_total", {**zero, "fail_closed": "false"}) == 0.0
    for state in m.PEER_STATES:
        for cause in m.EXPIRY_CAUSES:
            assert registry.get_sample_value("leasekit_kv_lease_expiries_total",
                                             {**zero, "cause": cause, "peer_state": state}) == 0.0
    assert registry.get_sample_value("leasekit_kv_lease_expired_peer_returns_total", zero) == 0.0
    assert registry.get_sample_value("leasekit_kv_lease_extensions_total", zero) == 0.0
    assert registry.get_sample_value(
        "leasekit_kv_lease_heartbeats_sent_total",
        {"model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": "0", "remote_engine_id": m.UNKNOWN_REMOTE}) is None

    # rank 0: A heartbeated at 101 and 102.5 then lapses; B released. rank 1: A never heartbeated.
    r0.extend("A", 105.0, remote_agent="agent-d", now=101.0)
    r0.extend("A", 106.5, remote_agent="agent-d", now=102.5)
    r0.release("B", now=103.0)
    r0.expire("A", step_gap_s=0.05, now=106.6)
    r1.expire("A", now=106.2)
    r1.late_read("A", remote_agent="agent-d", now=107.0)
    r0.late_read("A", remote_agent="agent-d", now=107.0, fail_closed=True)  # D told to discard it
    r1.abort("B", "request aborted", now=107.0)
    o0.state(r0.expiring_within(1.0, now=107.0))
    o1.state(r1.expiring_within(1.0, now=107.0))
    prom.observe(_shipped(s0, s1).data, 0)

    assert value(registry, "leasekit_kv_lease_extensions_total", tp_rank="0") == 2
    assert value(registry, "leasekit_kv_lease_heartbeat_gap_seconds_count", tp_rank="0") == 2
    assert value(registry, "leasekit_kv_lease_heartbeat_gap_seconds_sum", tp_rank="0") == pytest.approx(2.5)
    assert value(registry, "leasekit_kv_lease_releases_total", tp_rank="0") == 1
    # rank 0's D agent last heartbeated 4.1 s (> 2 H) before the reap: silent; rank 1 never heard of a D
    assert value(registry, "leasekit_kv_lease_expiries_total", tp_rank="0", cause="heartbeat_lapsed",
                 peer_state="silent") == 1
    assert value(registry, "leasekit_kv_lease_expiries_total", tp_rank="1", cause="no_heartbeat",
                 peer_state="unknown") == 1
    assert value(registry, "leasekit_kv_lease_reclaim_lag_seconds_sum", tp_rank="0") == pytest.approx(0.1)
    assert value(registry, "leasekit_kv_lease_reclaim_lag_seconds_sum", tp_rank="1") == pytest.approx(0.2)
    assert value(registry, "leasekit_kv_lease_late_completions_total", tp_rank="1", fail_closed="false") == 1
    assert value(registry, "leasekit_kv_lease_late_completions_total", tp_rank="0", fail_closed="true") == 1
    assert value(registry, "leasekit_kv_lease_late_completions_total", tp_rank="0", fail_closed="false") == 0
    assert value(registry, "leasekit_kv_lease_aborts_total", tp_rank="1") == 1
    assert value(registry, "leasekit_kv_lease_hold_seconds_count", tp_rank="0", outcome="expired") == 1
    assert value(registry, "leasekit_kv_lease_hold_seconds_sum", tp_rank="0", outcome="released") == pytest.approx(3.0)
    # conservation: pinned blocks and active leases back to zero on every rank
    for rank in ("0", "1"):
        assert value(registry, "leasekit_kv_leases_active", tp_rank=rank) == 0
        assert value(registry, "leasekit_kv_lease_pinned_blocks", tp_rank=rank) == 0
    # vLLM's own NIXL metrics are still registered, unchanged
    assert registry.get_sample_value(
        "vllm:nixl_num_kv_expired_reqs_total", {"model_name": "tiny", "engine": "0"}) == 0
    # nothing pending after shipping; every exported name is in the catalog
    assert s0.is_empty() and s1.is_empty()
    exported = {s.name for fam in registry.collect() for s in fam.samples if not s.name.endswith("_created")}
    assert exported <= m.exported_series_names()


def test_expiring_soon_counts_leases_within_one_heartbeat_interval():
    stats, observer, rec = _worker(0)
    rec.grant("A", 106.0, now=100.0)
    rec.grant("B", 106.0, now=100.0)
    rec.extend("B", 109.0, now=105.0)
    assert rec.expiring_within(TIMING.heartbeat_interval_s, now=105.5) == 1  # A: 0.5 s left; B: 3.5 s
    observer.state(1)
    observer.state(1)  # unchanged: not queued twice
    assert stats.data[stats_mod.STATE] == [[0, 2, 0, 1]]


def test_heartbeat_send_results_are_counted_per_remote_engine():
    registry = CollectorRegistry()
    prom = _prom(registry)
    stats, observer, _ = _worker(2)
    observer.heartbeat("P-engine", True)
    observer.heartbeat("P-engine", True)
    observer.heartbeat("P-engine", False)
    prom.observe(_shipped(stats).data, 0)
    assert value(registry, "leasekit_kv_lease_heartbeats_sent_total", tp_rank="2", remote_engine_id="P-engine") == 2
    assert value(registry, "leasekit_kv_lease_heartbeat_send_failures_total", tp_rank="2",
                 remote_engine_id="P-engine") == 1


def test_one_log_record_per_event_and_json_when_asked(capsys):
    logger = logging.getLogger("test.leasekit.lease")
    logger.setLevel(logging.DEBUG)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger.addHandler(Keep())
    _, _, rec = _worker(0, extra_observers=(LeaseLogObserver(logger),))
    rec.grant("R1", 106.0, kv_blocks=2, now=100.0)
    rec.extend("R1", 105.0, remote_agent="agent-d", now=101.0)
    rec.expire("R1", now=105.1)
    assert [r.event for r in records] == ["grant", "extend", "expire"]
    expire = records[-1]
    assert expire.levelno == logging.WARNING
    assert expire.request_id == "R1" and expire.tp_rank == 0 and expire.engine_id == "P0"
    assert expire.outcome == "expired" and expire.cause == "heartbeat_lapsed"
    assert expire.reclaim_lag_s == pytest.approx(0.1)

    json_logger = lease_logger({"LEASEKIT_LOG_FORMAT": "json"})
    try:
        LeaseLogObserver(json_logger)(records and _event("late_read"))
        line = capsys.readouterr().err.strip().splitlines()[-1]
        doc = json.loads(line)
        assert doc["event"] == "late_read" and doc["level"] == "ERROR" and doc["request_id"] == "R9"
        assert doc["tp_rank"] == 1 and doc["outcome"] == "expired"
        LeaseLogObserver(json_logger)(dataclasses.replace(_event("late_read"), fail_closed=True))
        doc = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert doc["event"] == "late_read" and doc["level"] == "WARNING"  # D discards it: no wrong tokens
    finally:
        for h in list(json_logger.handlers):
            if getattr(h, "_leasekit_json", False):
                json_logger.removeHandler(h)
        json_logger.propagate = True
    with pytest.raises(LogConfigError, match="LEASEKIT_LOG_FORMAT.*text, json"):
        lease_logger({"LEASEKIT_LOG_FORMAT": "xml"})


def _event(kind):
    from leasekit.telemetry.lease_events import LeaseEvent

    return LeaseEvent(kind, "R9", "P0", 1, "kv_producer", 10.0, outcome="expired", late_by_s=0.5)


def test_rate_limited_warning_counts_suppressed():
    now = [0.0]
    logger = logging.getLogger("test.leasekit.ratelimit")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    warning = RateLimitedWarning(logger, interval_s=10, clock=lambda: now[0])
    assert warning.warn("send failed to %s", "P")
    for t in (1.0, 2.0, 9.9):
        now[0] = t
        assert not warning.warn("send failed to %s", "P")
    now[0] = 10.5
    assert warning.warn("send failed to %s", "P")
    assert seen == ["send failed to P (0 similar suppressed)", "send failed to P (3 similar suppressed)"]
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedWarning(logger, interval_s=0)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_p_and_d_spans_join_the_request_trace_and_share_the_request_id():
    exporter = InMemorySpanExporter()
    _, _, p_rec = _worker(0, exporter)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    d_rec = HeartbeatSpanRecorder(provider.get_tracer("d"), engine_id="D0", tp_rank=0)
    headers = {"traceparent": TRACEPARENT}
    assert d_rec.track("P-req", remote_engine_id="P0", decode_request_id="D-req", trace_headers=headers, now=1.0)
    p_rec.grant("P-req", 106.0, trace_headers=headers, now=100.0)
    assert d_rec.sent(["P-req", "other"], now=2.0) == 1
    d_rec.sent(["P-req"], now=3.0)
    p_rec.release("P-req", now=101.0)
    assert d_rec.untrack("P-req", now=4.0)
    assert not d_rec.untrack("P-req")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    p_span, d_span = spans[sc.LEASE_SPAN_NAME], spans[sc.HEARTBEATS_SPAN_NAME]
    trace_id = int(TRACEPARENT.split("-")[1], 16)
    assert p_span.context.trace_id == d_span.context.trace_id == trace_id
    assert p_span.parent.span_id == int(TRACEPARENT.split("-")[2], 16)
    assert p_span.attributes[sc.REQUEST_ID] == d_span.attributes[sc.REQUEST_ID] == "P-req"
    assert d_span.attributes[sc.HEARTBEATS_SENT] == 2
    assert d_span.attributes[sc.FIRST_HEARTBEAT_MONOTONIC_S] == 2.0
    assert d_span.attributes[sc.DECODE_REQUEST_ID] == "D-req"
    # without trace headers (or with a malformed one) the lease span is a root span
    _, _, rec = _worker(0, exporter)
    rec.grant("X", 106.0, trace_headers={"traceparent": "garbage"}, now=100.0)
    rec.release("X", now=100.5)
    x = [s for s in exporter.get_finished_spans() if s.attributes.get(sc.REQUEST_ID) == "X"][0]
    assert x.parent is None and x.context.trace_id != trace_id


def test_span_files_write_ids_as_otlp_json_hex_and_read_base64_too(tmp_path):
    from leasekit.telemetry.spanfile import OtlpJsonLinesSpanExporter, parse_line, read_span_dir

    exporter = OtlpJsonLinesSpanExporter(tmp_path / "spans" / "p.jsonl")
    _, _, rec = _worker(0, exporter)
    rec.grant("R", 106.0, trace_headers={"traceparent": TRACEPARENT}, now=100.0)
    rec.release("R", now=101.0)
    line = (tmp_path / "spans" / "p.jsonl").read_text()
    trace_hex, parent_hex = TRACEPARENT.split("-")[1:3]
    assert f'"traceId":"{trace_hex}"' in line and f'"parentSpanId":"{parent_hex}"' in line  # OTLP/JSON: hex
    (span,) = read_span_dir(tmp_path / "spans").spans
    assert span.trace_id == trace_hex and span.parent_span_id == parent_hex and len(span.span_id) == 16
    import base64

    legacy = line.replace(trace_hex, base64.b64encode(bytes.fromhex(trace_hex)).decode())
    assert parse_line(legacy)[0].trace_id == trace_hex


def test_span_reader_skips_what_is_not_a_readable_span_file(tmp_path):
    from leasekit.telemetry.spanfile import read_span_dir

    spans = tmp_path / "spans"
    (spans / "dir.jsonl").mkdir(parents=True)  # a directory named like a span file
    (spans / "deep.jsonl").write_text("[" * 100000 + "\n")  # nesting beyond the JSON parser's recursion
    result = read_span_dir(spans)
    assert result.spans == [] and result.bad_lines == 1
