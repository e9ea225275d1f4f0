"""LeaseKit push D withholds the registration of a lease it fell silent on (push.py ``_lk_withhold_lapsed``):
vLLM's own push worker method runs on a LeaseKitPushWorker whose LeaseKit parts are real (the heartbeat span
recorder, the lease timing); only vLLM's engine state is absent. The real-pair proof is the stall-decode-push
scenario (a frozen D's requests are answered on LeaseKit, hang on stock). Also: D ranks never disagree (only a D with
TP 1 withholds), and a registration is judged after the forward-pass stall of its step."""

from __future__ import annotations

import logging
import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker  # noqa: E402

from leasekit.chaos import FAIL, PASS  # noqa: E402
from leasekit.chaos.checks import CheckResult  # noqa: E402
from leasekit.chaos.result import ScenarioResult  # noqa: E402
from leasekit.chaos.suite import _left_d_dirty  # noqa: E402
from leasekit.lease.config import LeaseTiming  # noqa: E402
from leasekit.telemetry.decode_spans import HeartbeatSpanRecorder  # noqa: E402
from leasekit.telemetry.lease_log import RateLimitedWarning  # noqa: E402
from leasekit.vllm.push import LeaseKitPushWorker  # noqa: E402
from leasekit.vllm.stats import WITHHELD, LeaseKitKVConnectorStats, LeaseStatsObserver  # noqa: E402
from leasekit.vllm.taps import TelemetryErrors  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_worker(clock):
    worker = object.__new__(LeaseKitPushWorker)
    worker._lk_ready = True
    worker._lk_timing = LeaseTiming.from_lease_duration(6)  # H = 1, E = 4: withheld from 3.5 s of silence
    worker._lk_hb = HeartbeatSpanRecorder(TracerProvider().get_tracer("t"), engine_id="d", tp_rank=0, clock=clock)
    worker._failed_recv_reqs = queue.Queue()
    worker._lk_withheld_warning = RateLimitedWarning(logging.getLogger("leasekit.test"))
    worker._lk_errors = TelemetryErrors(logging.getLogger("leasekit.test"))
    worker._lk_stats = LeaseStatsObserver(LeaseKitKVConnectorStats(), 0)
    return worker


def test_a_registration_after_a_silence_near_e_is_withheld_and_its_load_failed(monkeypatch):
    clock = Clock()
    worker = make_worker(clock)
    monkeypatch.setattr("leasekit.vllm.push.time.perf_counter", clock)
    for d_id, p_id in (("d-frozen", "p-frozen"), ("d-fine", "p-fine")):
        worker._lk_hb.track(p_id, remote_engine_id="P", decode_request_id=d_id, now=clock.now)
    worker._lk_hb.sent(["p-frozen", "p-fine"], now=100.5)
    worker._lk_hb.sent(["p-fine"], now=103.0)  # D heartbeats p-fine; p-frozen silent since 100.5
    clock.now = 104.0  # 3.5 s of silence for p-frozen: E - H/2 at L = 6
    regs = {"d-frozen": {"request_id": "d-frozen"}, "d-fine": {"request_id": "d-fine"}, "d-new": {}}
    worker._lk_withhold_lapsed(SimpleNamespace(push_registrations=regs))
    assert list(regs) == ["d-fine", "d-new"]  # an untracked request (just arrived) is not judged
    assert worker._failed_recv_reqs.get_nowait() == "d-frozen" and worker._failed_recv_reqs.empty()
    assert worker._lk_stats.stats.data[WITHHELD] == [[0, 1]]  # leasekit_kv_lease_push_registrations_withheld_total


def test_a_silence_within_the_loss_budget_withholds_nothing(monkeypatch):
    clock = Clock()
    worker = make_worker(clock)
    monkeypatch.setattr("leasekit.vllm.push.time.perf_counter", clock)
    worker._lk_hb.track("p-1", remote_engine_id="P", decode_request_id="d-1", now=100.0)
    worker._lk_hb.sent(["p-1"], now=100.5)
    worker._lk_hb.sent(["p-1"], now=103.5)  # two batches lost: 3 s, the loss budget's silence
    clock.now = 104.0
    regs = {"d-1": {}}
    worker._lk_withhold_lapsed(SimpleNamespace(push_registrations=regs))
    assert list(regs) == ["d-1"] and worker._failed_recv_reqs.empty()


def test_a_failure_inside_never_reaches_the_engine(caplog):
    worker = make_worker(Clock())
    with caplog.at_level(logging.WARNING, logger="leasekit.test"):
        worker._lk_withhold_lapsed(SimpleNamespace(push_registrations=None))  # not a dict: reported, not raised
    assert "withhold" in caplog.text and worker._failed_recv_reqs.empty()


def test_a_pair_whose_d_kept_requests_or_blocks_is_not_reused():
    def result(*checks):
        r = ScenarioResult("s", "stock", FAIL, FAIL, "x")
        r.checks = [CheckResult(name, verdict, "") for name, verdict in checks]
        return r

    assert _left_d_dirty(result(("liveness", FAIL)))
    assert _left_d_dirty(result(("bounded-reclaim", PASS), ("decode-conservation", FAIL)))
    assert not _left_d_dirty(result(("liveness", PASS), ("conservation", FAIL)))


def test_every_d_rank_decides_the_same_for_the_same_registration(monkeypatch):
    """Two D TP ranks, same request, same metadata. Rank 1's first heartbeat waited for its NIXL handshake
    (base_worker ``_send_heartbeats`` ``continue``), rank 0's did not: 0.2 s apart in their histories."""
    clock = Clock()
    monkeypatch.setattr("leasekit.vllm.push.time.perf_counter", clock)
    rank0, rank1 = make_worker(clock), make_worker(clock)
    for rank in (rank0, rank1):
        rank._lk_hb.track("p-1", remote_engine_id="P", decode_request_id="d-1", now=100.0)
    rank0._lk_hb.sent(["p-1"], now=100.3)   # rank 0 handshaked early
    rank1._lk_hb.sent(["p-1"], now=100.5)   # rank 1's handshake finished 0.2 s later
    clock.now = 103.9                       # then D stalled; registration judged now
    regs0, regs1 = {"d-1": {}}, {"d-1": {}}  # each rank gets its own copy of the metadata (multiproc executor)
    for rank in (rank0, rank1):
        rank.world_size = 2  # D TP 2: ranks judge from their own histories, so none withholds (docs/chaos.md)
    rank0._lk_before_stock_load(SimpleNamespace(push_registrations=regs0))
    rank1._lk_before_stock_load(SimpleNamespace(push_registrations=regs1))
    # rank 0: silence 3.6 s >= 3.5 -> withheld, load failed; rank 1: 3.4 s -> registers, P WRITEs (all D ranks
    # when D TP > P TP) into blocks rank 0 has already reported invalid.
    assert list(regs0) == list(regs1) == ["d-1"] and rank0._failed_recv_reqs.empty() and rank1._failed_recv_reqs.empty()
    rank0.world_size = 1  # D TP 1: the same history is withheld
    rank0._lk_before_stock_load(SimpleNamespace(push_registrations=regs0))
    assert regs0 == {} and rank0._failed_recv_reqs.get_nowait() == "d-1"


def test_a_registration_is_judged_after_the_forward_pass_stall_of_its_step(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("leasekit.vllm.push.time.perf_counter", clock)
    worker = make_worker(clock)
    worker._lk_hb.track("p-1", remote_engine_id="P", decode_request_id="d-1", now=100.0)
    worker._lk_hb.sent(["p-1"], now=100.5)
    clock.now = 101.0

    def stall():  # chaos method = "forward_pass": the fault point sleeps in start_load_kv (8 s here)
        clock.now += 8.0

    worker._lk_faults = SimpleNamespace(enabled=True)
    worker._lk_dbeats = SimpleNamespace(apply_stall=stall, track=lambda *a: None)
    worker._lk_gate = SimpleNamespace(protect=lambda *a: None, finish=lambda *a: None)
    worker._lk_p = SimpleNamespace(pledges=SimpleNamespace(take=lambda *a: None), take_metadata=lambda *a: None)
    sent_to_writer = {}
    monkeypatch.setattr(NixlPushConnectorWorker, "start_load_kv",
                        lambda self, md: sent_to_writer.update(md.push_registrations or {}))
    metadata = SimpleNamespace(push_registrations={"d-1": {}}, reqs_to_send={})
    worker.start_load_kv(metadata)
    # vLLM queued the registration for the writer 8.5 s after D's last heartbeat (P reclaims at E = 4 s)
    assert sent_to_writer == {} and worker._failed_recv_reqs.get_nowait() == "d-1"


def test_d_push_counts_keep_one_entry_per_rank_per_step():
    from leasekit.vllm.stats import LATE_WRITES

    stats = LeaseStatsObserver(LeaseKitKVConnectorStats(), 3)
    stats.late_write()
    stats.late_write()
    stats.registration_withheld()
    assert stats.stats.data[LATE_WRITES] == [[3, 2]] and stats.stats.data[WITHHELD] == [[3, 1]]
