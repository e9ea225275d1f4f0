"""LeaseSpanRecorder: one span per lease, an event per transition, written to the span file."""

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.lease import LeaseTiming
from leasekit.lease.peerref import peer_ref
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_spans import LeaseSpanRecorder
from leasekit.telemetry.lease_timeline import lease_timelines
from leasekit.telemetry.spanfile import OtlpJsonLinesSpanExporter, read_span_dir

TIMING = LeaseTiming.from_lease_duration(30)


def recorder(exporter, **kwargs):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return LeaseSpanRecorder(provider.get_tracer("t"), engine_id="P0", tp_rank=3, timing=TIMING, **kwargs)


def test_k01_lease_span_has_grant_extends_and_expired_end():
    exporter = InMemorySpanExporter()
    rec = recorder(exporter)
    assert rec.grant("R", 130.0, kv_blocks=8, now=100.0)  # granted at 100: deadline 130
    for t in (101.0, 106.0, 111.0):
        assert rec.extend("R", max(130.0, t + 20), remote_agent="D-agent", now=t)
    assert rec.active == 1
    assert rec.expire("R", step_gap_s=0.1, now=131.05)
    assert rec.active == 0
    (span,) = exporter.get_finished_spans()
    a = span.attributes
    assert span.name == sc.LEASE_SPAN_NAME
    assert a[sc.REQUEST_ID] == "R" and a[sc.TP_RANK] == 3 and a[sc.KV_BLOCKS] == 8
    assert a[sc.OUTCOME] == sc.OUTCOME_EXPIRED and a[sc.EXTEND_COUNT] == 3
    assert a[sc.REMOTE_AGENT] == peer_ref("D-agent")  # a reference, never the agent name
    assert "D-agent" not in repr(dict(a)) and "D-agent" not in repr([dict(e.attributes) for e in span.events])
    assert a[sc.EXPIRY_PEER_STATE] == "silent"  # last heard 20.05 s (> 2 H = 10 s) before the reap
    assert a[sc.GRANT_MONOTONIC_S] == 100.0 and a[sc.LAST_EXTEND_MONOTONIC_S] == 111.0
    assert a[sc.DEADLINE_MONOTONIC_S] == 131.0
    assert a[sc.RECLAIM_LAG_S] == pytest.approx(0.05)
    assert [e.name for e in span.events] == ["grant", "extend", "extend", "extend", "expire"]
    assert span.events[1].attributes[sc.EV_DEADLINE_REMAINING_S] == pytest.approx(29.0)


def test_release_is_idempotent_and_unknown_ids_are_ignored():
    exporter = InMemorySpanExporter()
    rec = recorder(exporter)
    rec.grant("R", 30.0, now=0.0)
    assert not rec.grant("R", 99.0, now=1.0)  # a second grant does not restart the lease
    assert rec.retrieval("R", remote_agent="D", now=2.0)
    assert rec.release("R", now=2.0)
    assert not rec.release("R", now=3.0)
    assert not rec.expire("R", now=31.0)
    assert not rec.extend("nope", 50.0)
    assert not rec.abort("nope", "x")
    (span,) = exporter.get_finished_spans()
    assert span.attributes[sc.OUTCOME] == sc.OUTCOME_RELEASED
    assert span.attributes[sc.RETRIEVALS] == 1


def test_extend_events_are_capped_but_counted():
    exporter = InMemorySpanExporter()
    rec = recorder(exporter, max_extend_events=2)
    rec.grant("R", 30.0, now=0.0)
    for i in range(5):
        rec.extend("R", 30.0 + i, now=float(i + 1))
    rec.abort_all("worker shutdown")
    (span,) = exporter.get_finished_spans()
    assert [e.name for e in span.events].count("extend") == 2
    assert span.attributes[sc.EXTEND_COUNT] == 5
    assert span.attributes[sc.EXTEND_EVENTS_DROPPED] == 3
    assert span.attributes[sc.LAST_EXTEND_MONOTONIC_S] == 5.0
    assert span.attributes[sc.OUTCOME] == sc.OUTCOME_ABORTED
    assert span.attributes[sc.ABORT_REASON] == "worker shutdown"


def test_negative_event_cap_is_refused():
    with pytest.raises(ValueError, match="max_extend_events"):
        recorder(InMemorySpanExporter(), max_extend_events=-1)


def test_span_file_round_trip_into_lease_timelines(tmp_path):
    exporter = OtlpJsonLinesSpanExporter(tmp_path / "spans" / "p.jsonl")
    rec = recorder(exporter)
    rec.grant("A", 30.0, kv_blocks=2, now=0.0)
    rec.grant("B", 31.0, now=1.0)
    rec.extend("A", 26.0 + 20, now=26.0)
    rec.release("B", now=5.0)
    rec.expire("A", now=46.2)
    exporter.shutdown()
    # a corrupt line is counted; a torn last line (killed or still writing) is skipped, not fatal
    with open(tmp_path / "spans" / "p.jsonl", "a") as f:
        f.write('{"resourceSpans": 7}\nnot json\n{"resourceSpans": [')
    result = read_span_dir(tmp_path / "spans")
    assert result.bad_lines == 2 and result.incomplete_tails == 1
    leases = {t.request_id: t for t in lease_timelines(result.spans)}
    assert set(leases) == {"A", "B"}
    a, b = leases["A"], leases["B"]
    assert (a.outcome, a.grant_s, a.last_heartbeat_s, a.end_s, a.kv_blocks) == ("expired", 0.0, 26.0, 46.2, 2)
    assert a.heartbeats_s == (26.0,) and a.heartbeat_count == 1
    assert (b.outcome, b.heartbeat_count, b.kv_blocks) == ("released", 0, None)
    assert [name for name, _ in a.events] == ["grant", "extend", "expire"]


def test_reading_a_missing_directory_finds_nothing(tmp_path):
    result = read_span_dir(tmp_path / "none")
    assert result.spans == [] and result.bad_lines == 0


def test_kept_extension_events_are_the_first_and_the_latest_with_their_counts():
    exporter = InMemorySpanExporter()
    rec = recorder(exporter)  # default: 8 extension events kept
    rec.grant("R", 130.0, now=100.0)
    for k in range(1, 21):
        rec.extend("R", 120.0 + k, remote_agent="D", now=100.0 + k)
    rec.retrieval("R", remote_agent="D", now=120.5)
    rec.release("R", now=121.0)
    (span,) = exporter.get_finished_spans()
    extends = [e for e in span.events if e.name == sc.EVENT_EXTEND]
    assert [e.attributes[sc.EV_EXTEND_COUNT] for e in extends] == [1, 14, 15, 16, 17, 18, 19, 20]
    assert [e.attributes[sc.EV_MONOTONIC_S] for e in extends] == [101.0] + [100.0 + k for k in range(14, 21)]
    assert span.attributes[sc.EXTEND_COUNT] == 20 and span.attributes[sc.EXTEND_EVENTS_DROPPED] == 12
    assert [e.name for e in span.events][-3:] == ["extend", "retrieval", "release"]  # time order
    assert all(a.timestamp <= b.timestamp for a, b in zip(span.events, span.events[1:]))


def test_an_extension_event_is_built_only_for_observers_that_want_it():
    """Per-heartbeat cost: an observer whose ``wants`` refuses extensions (a lease log above DEBUG) gets no
    extension event and none is built; one without ``wants`` gets every event; other kinds still reach both."""
    seen = {"picky": [], "all": []}

    class Picky:
        def wants(self, kind):
            return kind != "extend"

        def __call__(self, event):
            seen["picky"].append(event.kind)

    rec = recorder(InMemorySpanExporter(), observers=(Picky(), lambda event: seen["all"].append(event.kind)))
    rec.grant("R1", 130.0, now=100.0)
    rec.extend("R1", 135.0, remote_agent="d", now=105.0)
    rec.release("R1", now=106.0)
    assert seen == {"picky": ["grant", "release"], "all": ["grant", "extend", "release"]}
    only_picky = recorder(InMemorySpanExporter(), observers=(Picky(),))
    only_picky.grant("R2", 130.0, now=100.0)
    assert only_picky.extend("R2", 135.0, now=105.0) and seen["picky"][-1] == "grant"
