"""Review findings on push-mode D withholding (push.py ``_lk_before_stock_load``), now regression tests: D ranks never
disagree (only a D with TP 1 withholds), and a registration is judged after the forward-pass stall of its step. Real
LeaseKit parts (heartbeat span recorder, lease timing); vLLM's engine state absent."""

from __future__ import annotations

import logging
import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker  # noqa: E402

from leasekit.lease.config import LeaseTiming  # noqa: E402
from leasekit.telemetry.decode_spans import HeartbeatSpanRecorder  # noqa: E402
from leasekit.telemetry.lease_log import RateLimitedWarning  # noqa: E402
from leasekit.vllm.push import LeaseKitPushWorker  # noqa: E402
from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseStatsObserver  # noqa: E402
from leasekit.vllm.taps import TelemetryErrors  # noqa: E402


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_worker(clock, lease_duration_s=6):
    worker = object.__new__(LeaseKitPushWorker)
    worker._lk_ready = True
    worker._lk_timing = LeaseTiming.from_lease_duration(lease_duration_s)
    worker._lk_hb = HeartbeatSpanRecorder(TracerProvider().get_tracer("t"), engine_id="d", tp_rank=0, clock=clock)
    worker._failed_recv_reqs = queue.Queue()
    worker._lk_withheld_warning = RateLimitedWarning(logging.getLogger("leasekit.test"))
    worker._lk_errors = TelemetryErrors(logging.getLogger("leasekit.test"))
    worker._lk_stats = LeaseStatsObserver(LeaseKitKVConnectorStats(), 0)
    return worker


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
