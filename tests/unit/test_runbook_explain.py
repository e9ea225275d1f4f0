"""``leasekit explain``: lease timelines from span files written by the real span writer
(LeaseSpanRecorder / HeartbeatSpanRecorder -> build_tracer_provider -> OTLP JSON-lines file)."""

import argparse
import json
import os

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.peerref import peer_ref
from leasekit.runbook import explain
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.decode_spans import HeartbeatSpanRecorder
from leasekit.telemetry.lease_spans import LeaseSpanRecorder
from leasekit.telemetry.provider import build_tracer_provider

L6 = LeaseTiming.from_lease_duration(6)  # H = 1, E = 4


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="leasekit")
    explain.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


class Worker:
    """One P (or D) worker process's span writer, as the connector builds it."""

    def __init__(self, run_dir, *, engine="P0", rank=0, role="kv_producer", decode=False):
        self.provider, _ = build_tracer_provider(
            run_dir=run_dir, file_stem=f"{role}-{engine}-tp{rank}",
            resource_attributes={"leasekit.engine_id": engine, "leasekit.tp_rank": rank, "leasekit.kv_role": role,
                                 "process.pid": os.getpid()}, env={})
        tracer = self.provider.get_tracer("leasekit.vllm")
        if decode:
            self.rec = HeartbeatSpanRecorder(tracer, engine_id=engine, tp_rank=rank, kv_role=role)
        else:
            self.rec = LeaseSpanRecorder(tracer, engine_id=engine, tp_rank=rank, timing=L6, kv_role=role)

    def close(self):
        self.provider.shutdown()


def released_pair(run_dir, req="req-released-1", decode_id="cmpl-d-77"):
    """A request served by 2 P ranks, heartbeated by D, read and released on both ranks."""
    for rank in (0, 1):
        w = Worker(run_dir, rank=rank)
        assert w.rec.grant(req, 106.0, kv_blocks=8, now=100.0)
        assert w.rec.extend(req, max(106.0, 101.0 + 4), remote_agent="D-agent", now=101.0)  # max(expiry, now + E)
        assert w.rec.retrieval(req, remote_agent="D-agent", now=101.5)
        assert w.rec.release(req, now=101.5)
        w.close()
    d = Worker(run_dir, engine="D0", role="kv_consumer", decode=True)
    assert d.rec.track(req, remote_engine_id="P0", decode_request_id=decode_id, now=50.0)
    assert d.rec.sent([req], now=51.0) == 1
    assert d.rec.untrack(req, "read done", now=51.6)
    d.close()


def expired(run_dir, req, *, extends=(101.0, 102.5), end=106.6, step_gap=0.2, late_at=None):
    w = Worker(run_dir)
    assert w.rec.grant(req, 106.0, kv_blocks=4, now=100.0)
    for t in extends:
        assert w.rec.extend(req, max(106.0, t + 4), remote_agent="D-agent", now=t)
    assert w.rec.expire(req, step_gap_s=step_gap, now=end)
    if late_at is not None:
        assert w.rec.late_read(req, remote_agent="D-agent", now=late_at)
    w.close()


def test_released_lease_on_two_ranks_with_the_decode_side_span(tmp_path, capsys):
    released_pair(tmp_path / "leasekit-run")
    assert run_cli(["explain", "req-released-1", "--run-dir", str(tmp_path / "leasekit-run"), "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["request_id"] == "req-released-1" and report["matched_by"] == "exact"
    assert report["searched"]["lease_spans"] == 2 and report["searched"]["files"] == 3
    assert [(v["tp_rank"], v["outcome"]) for v in report["leases"]] == [(0, "released"), (1, "released")]
    lease = report["leases"][0]
    assert [e["event"] for e in lease["events"]] == ["grant", "extend", "retrieval", "release"]
    assert [e["t_after_grant_s"] for e in lease["events"]] == [0.0, 1.0, 1.5, 1.5]
    assert lease["events"][0]["deadline_remaining_s"] == 6.0
    assert lease["events"][1]["deadline_remaining_s"] == 5.0
    assert lease["events"][0]["wall_time"].endswith("Z")
    assert lease["extend_count"] == 1 and lease["extend_events_kept"] == 1 and lease["retrievals"] == 1
    assert lease["kv_blocks"] == 8 and lease["remote_agent"] == peer_ref("D-agent") and lease["kv_role"] == "kv_producer"
    assert lease["end_s"] == 1.5 and lease["deadline_s"] == 6.0
    assert lease["bound"]["verdict"] == "NOT_APPLICABLE"
    assert report["late_reads"] == []
    (d,) = report["other_spans"]
    assert d["span"] == sc.HEARTBEATS_SPAN_NAME and d["kv_role"] == "kv_consumer" and d["engine_id"] == "D0"
    assert [e["event"] for e in d["events"]] == ["tracked", "first_heartbeat", "untracked"]
    assert [e["t_own_clock_s"] for e in d["events"]] == [0.0, 1.0, pytest.approx(1.6)]
    assert d["attributes"][sc.HEARTBEATS_SENT] == 1
    # the decode-side request id finds the same request
    assert run_cli(["explain", "cmpl-d-77", "--run-dir", str(tmp_path / "leasekit-run"), "-o", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["other_spans"]) == 1


def test_expired_lease_bound_and_late_read_in_nested_chaos_dirs(tmp_path, capsys):
    run = tmp_path / "chaos-run"
    released_pair(run / "kill-decode" / "leasekit")  # other scenarios' pairs live in subdirectories
    expired(run / "stall-decode" / "leasekit", "req-expired-9", late_at=107.0)
    assert run_cli(["explain", "req-expired-9", "--run-dir", str(run), "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["searched"]["span_dirs"]) == 2 and report["searched"]["lease_spans"] == 3
    (lease,) = report["leases"]
    assert lease["outcome"] == "expired" and lease["extend_count"] == 2
    assert lease["last_extend_s"] == 2.5 and lease["deadline_s"] == 6.5
    assert lease["reclaim_lag_s"] == pytest.approx(0.1) and lease["step_gap_s"] == 0.2
    assert lease["events"][-1]["event"] == "expire"
    assert lease["events"][-1]["t_after_grant_s"] == pytest.approx(6.6)
    bound = lease["bound"]
    assert bound["verdict"] == "WITHIN_BOUND"
    assert bound["grant_plus_L_s"] == 6.0 and bound["last_extend_plus_E_s"] == 6.5
    assert bound["reclaim_deadline_s"] == 6.5 and bound["recorded_deadline_s"] == 6.5
    assert bound["actual_end_s"] == pytest.approx(6.6) and bound["lag_s"] == pytest.approx(0.1)
    # default allowance: max(H, 0.5 s) = 1 s, as LeaseReclaimLagOverBound; the step gap is shown only
    assert bound["tick_s"] == 1.0 and bound["bound_s"] == pytest.approx(7.5)
    assert "step gap before this reap was 0.200 s" in bound["tick_source"]
    (late,) = report["late_reads"]
    assert late["ended_outcome"] == "expired" and late["late_by_s"] == pytest.approx(0.4)
    assert late["t_after_grant_s"] == pytest.approx(7.0) and late["end_after_grant_s"] == pytest.approx(6.6)
    assert late["remote_agent"] == peer_ref("D-agent")
    assert lease["expiry_peer_state"] == "silent"  # last heard 4.1 s (> 2 H) before the reap
    # the table
    assert run_cli(["explain", "req-expired-9", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "bound check: WITHIN_BOUND: reclaimed 0.100 s after its deadline max(grant + L = 6.000, " \
           "last_extend + E = 6.500) = 6.500 s" in out
    assert "LATE READ kv_lease_late_read engine=P0 tp_rank=0 kv_role=kv_producer" in out
    assert f"remote peer {peer_ref('D-agent')}" in out and "D-agent" not in out
    assert "D at expiry" in out and "silent" in out
    assert "+7.000 s after the grant" in out and "extend_count / events kept" in out


def test_bound_exceeded_premature_and_tick_override(tmp_path, capsys):
    # lag 2.0 s > the default allowance max(H, 0.5) = 1 s, though P's step gap (a stall) was 2.0 s
    expired(tmp_path, "slow-reap", extends=(), end=108.0, step_gap=2.0)
    expired(tmp_path, "early-reap", extends=(103.0,), end=106.5, step_gap=0.1)  # deadline 107: premature
    code, report, _ = explain.explain("slow-reap", str(tmp_path))
    assert code == 0
    bound = report["leases"][0]["bound"]
    assert bound["verdict"] == "EXCEEDED" and bound["last_extend_plus_E_s"] is None
    assert bound["reclaim_deadline_s"] == 6.0 and bound["lag_s"] == pytest.approx(2.0)
    assert "exceeded by 1.000 s" in bound["detail"]
    _, report, _ = explain.explain("slow-reap", str(tmp_path), tick_s=2.5)
    assert report["leases"][0]["bound"]["verdict"] == "WITHIN_BOUND"
    assert report["leases"][0]["bound"]["tick_source"] == "--tick"
    _, report, _ = explain.explain("early-reap", str(tmp_path))
    assert report["leases"][0]["bound"]["verdict"] == "PREMATURE"
    assert "BEFORE its deadline" in report["leases"][0]["bound"]["detail"]


def test_not_found_exits_1_and_says_what_was_searched(tmp_path, capsys):
    released_pair(tmp_path / "a")
    expired(tmp_path / "b", "req-expired-9")
    assert run_cli(["explain", "nope", "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no span names request id 'nope'" in err
    assert "searched 3 lease span(s)" in err and "in 2 span dir(s)" in err
    assert str(tmp_path / "a" / "spans") in err and str(tmp_path / "b" / "spans") in err


def test_prefix_match_when_unique_and_refused_when_ambiguous(tmp_path, capsys, monkeypatch):
    expired(tmp_path, "cmpl-abc123-0")
    expired(tmp_path, "cmpl-abd999-0")
    monkeypatch.setenv("LEASEKIT_RUN_DIR", str(tmp_path))  # the default run dir
    assert run_cli(["explain", "cmpl-abc", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["request_id"] == "cmpl-abc123-0" and report["matched_by"] == "prefix"
    assert report["query"] == "cmpl-abc" and len(report["leases"]) == 1
    assert run_cli(["explain", "cmpl-ab"]) == 1
    err = capsys.readouterr().err
    assert "matches 2 requests (cmpl-abc123-0, cmpl-abd999-0)" in err


def test_a_prefix_shared_by_ps_and_ds_request_ids_names_ps_lease(tmp_path, capsys):
    # the router sends P and D one X-Request-Id: vLLM makes cmpl-<id>-0-<8 hex> of it on each side
    released_pair(tmp_path, "cmpl-x1-0-aaaaaaaa", decode_id="cmpl-x1-0-bbbbbbbb")
    released_pair(tmp_path, "cmpl-x2-0-cccccccc", decode_id="cmpl-x2-0-dddddddd")
    assert run_cli(["explain", "cmpl-x1", "--run-dir", str(tmp_path), "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["request_id"] == "cmpl-x1-0-aaaaaaaa" and report["matched_by"] == "prefix"
    assert run_cli(["explain", "cmpl-x", "--run-dir", str(tmp_path)]) == 1  # two leases: still ambiguous
    assert "matches 4 requests" in capsys.readouterr().err


def test_torn_last_line_is_skipped_and_counted(tmp_path, capsys):
    expired(tmp_path, "req-1")
    (span_file,) = (tmp_path / "spans").glob("*.jsonl")
    with open(span_file, "a") as f:
        f.write('{"resourceSpans": [')  # a writer killed mid-line
    code, report, _ = explain.explain("req-1", str(tmp_path))
    assert code == 0 and report["searched"]["incomplete_tails"] == 1 and len(report["leases"]) == 1


def test_corrupt_span_lines_are_skipped_and_said(tmp_path, capsys):
    expired(tmp_path, "req-1")
    (tmp_path / "spans" / "junk.jsonl").write_text("not json\n{\"resourceSpans\": 3}\n")
    assert run_cli(["explain", "req-1", "--run-dir", str(tmp_path), "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["searched"]["bad_lines"] >= 1
    assert "unreadable span line(s) skipped" in captured.err
    assert run_cli(["explain", "nope", "--run-dir", str(tmp_path)]) == 1
    assert "unreadable line(s) skipped (corrupt span files)" in capsys.readouterr().err


def test_missing_run_dir_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LEASEKIT_RUN_DIR", raising=False)
    assert run_cli(["explain", "x"]) == 2
    assert "run dir leasekit-run is not a directory" in capsys.readouterr().err


def test_bound_is_unknown_when_times_cannot_be_on_one_clock():
    from leasekit.runbook.timeline import bound_check
    from leasekit.telemetry.spanfile import SpanRecord

    attributes = {sc.OUTCOME: "expired", sc.GRANT_MONOTONIC_S: 100.0, sc.LEASE_DURATION_S: 6.0,
                  sc.EXTENSION_S: 4.0, sc.END_MONOTONIC_S: 106.1, sc.LAST_EXTEND_MONOTONIC_S: 90.0}
    span = SpanRecord("t", "s", "", sc.LEASE_SPAN_NAME, 0, 0, attributes, (), {})
    bound = bound_check(span)
    assert bound["verdict"] == "UNKNOWN" and "precedes grant_s" in bound["detail"]
