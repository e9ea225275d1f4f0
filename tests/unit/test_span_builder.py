"""SpanBuilder: lease spans built off the caller's thread, in order, bounded, never blocking the caller."""

import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.lease import LeaseTiming
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_spans import LeaseSpanRecorder
from leasekit.telemetry.span_builder import SpanBuilder


def test_inline_builder_runs_at_once_and_counts_failures():
    builder, seen = SpanBuilder(background=False), []
    assert builder.submit(lambda: seen.append(1))
    assert builder.submit(lambda: 1 / 0)  # a failing build is counted, never raised
    assert seen == [1] and builder.failed == 1 and builder.flush(0.0)


def test_background_builder_runs_in_order_on_another_thread():
    builder, seen = SpanBuilder(), []
    caller = threading.get_ident()
    for i in range(500):
        builder.submit(lambda i=i: seen.append((i, threading.get_ident())))
    assert builder.flush(10.0)
    assert [i for i, _ in seen] == list(range(500))
    assert {t for _, t in seen} != {caller}
    assert builder.close(1.0) and not builder.submit(lambda: None) and builder.dropped == 1


def test_a_stuck_build_never_blocks_submit_and_the_overflow_is_counted():
    release, seen = threading.Event(), []
    builder = SpanBuilder(max_pending=10)
    builder.submit(release.wait)  # the thread is stuck inside this one
    while builder._queue:  # wait until the thread took it
        pass
    results = [builder.submit(lambda i=i: seen.append(i)) for i in range(25)]  # returns at once
    assert results == [True] * 10 + [False] * 15 and builder.dropped == 15
    assert not builder.flush(0.2)  # still stuck
    release.set()
    assert builder.flush(10.0) and seen == list(range(10))
    builder.close()


def test_close_gives_up_on_a_stuck_build_and_counts_what_it_left():
    release = threading.Event()
    builder = SpanBuilder()
    builder.submit(release.wait)
    for _ in range(3):
        builder.submit(lambda: None)
    assert builder.close(0.2) is False
    assert builder.dropped >= 3
    release.set()


def test_recorder_spans_built_in_the_background_carry_the_transition_times():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    builder = SpanBuilder()
    rec = LeaseSpanRecorder(provider.get_tracer("t"), engine_id="P", tp_rank=0,
                            timing=LeaseTiming.from_lease_duration(30), spans=builder)
    rec.grant("R", 130.0, now=100.0)
    rec.extend("R", 121.0, remote_agent="D", now=101.0)
    rec.release("R", now=102.0)
    rec.late_read("R", remote_agent="D", now=103.0)
    assert rec.flush(10.0)
    lease, late = sorted(exporter.get_finished_spans(), key=lambda s: s.name)
    assert lease.name == sc.LEASE_SPAN_NAME and late.name == sc.LATE_READ_SPAN_NAME
    assert [e.name for e in lease.events] == ["grant", "extend", "release"]
    assert lease.end_time - lease.start_time == pytest.approx(2e9, abs=1e6)  # grant at 100, release at 102
    assert lease.events[1].timestamp - lease.start_time == pytest.approx(1e9, abs=1e6)
    assert lease.attributes[sc.OUTCOME] == sc.OUTCOME_RELEASED and late.attributes[sc.LATE_BY_S] == 1.0
    builder.close()


def test_max_pending_must_be_positive():
    with pytest.raises(ValueError, match="max_pending"):
        SpanBuilder(max_pending=0)


def test_a_burst_of_lease_ends_waits_for_the_exporter_instead_of_dropping(tmp_path, monkeypatch):
    """A dead D's leases expire in one reap: many more spans end at once than the span file's export
    queue holds. The builder's thread waits for room (it is not the engine's), so none is dropped."""
    from leasekit.telemetry import batching
    from leasekit.telemetry.provider import build_tracer_provider

    monkeypatch.setattr(batching, "MAY_WAIT_S", 60.0)  # the mechanism, not the bound: a loaded CI host is slow

    provider, _ = build_tracer_provider(run_dir=tmp_path, file_stem="p", resource_attributes={}, env={})
    builder = SpanBuilder()
    rec = LeaseSpanRecorder(provider.get_tracer("t"), engine_id="P", tp_rank=0,
                            timing=LeaseTiming.from_lease_duration(30), spans=builder)
    n = 8000  # the span file's queue holds 2048
    for i in range(n):
        rec.grant(f"r{i}", 130.0, now=100.0)
        rec.extend(f"r{i}", 131.0, remote_agent="D", now=111.0)
    for i in range(n):
        rec.expire(f"r{i}", now=131.5)
    assert builder.flush(60.0) and builder.dropped == 0
    assert provider.force_flush()
    counts = provider.span_export_counts()["file"]
    assert (counts.ended, counts.exported, counts.dropped_queue_full) == (n, n, 0)
    builder.close()
    provider.shutdown()
