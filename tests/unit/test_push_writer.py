"""P's push writer thread in LeaseKitPushWorker (push.py): a WRITE whose lease P's reap already ended is never
submitted (its source blocks may be reused), the reap never waits on the writer, a chaos writer stall sleeps before
the submission, and the reap judges D's silence only up to the writer's last poll. vLLM's own WRITE submission is
replaced by a recorder here (it needs NIXL and a handshaked D); the real-pair proof is the stall-writer-push
scenario (no lease of a heartbeating D expires while P's writer is stalled)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker  # noqa: E402

from leasekit.lease.config import LeaseTiming  # noqa: E402
from leasekit.vllm.faultpoints import FaultPoints, read_state, write_control  # noqa: E402
from leasekit.vllm.prefill.hooks import PHooks  # noqa: E402
from leasekit.vllm.push import LeaseKitPushWorker  # noqa: E402
from leasekit.vllm.pushflow import PushFlow  # noqa: E402


@pytest.fixture
def worker(monkeypatch):
    submitted: list[str] = []

    def stock_submit(self, req_id, meta):  # vLLM's submission: one WRITE handle per call
        with self._sending_transfers_lock:
            self._sending_transfers.setdefault(req_id, []).append(1)
        submitted.append(req_id)

    monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks_for_req", stock_submit)
    w = object.__new__(LeaseKitPushWorker)
    w._lk_ready = True
    w._lk_timing = LeaseTiming.from_lease_duration(6)  # E = 4
    w._lk_faults = FaultPoints(None)
    w._reqs_to_send = {"live": 110.0, "old": 90.0}
    w._sending_transfers, w._sending_transfers_lock = {}, threading.Lock()
    w._lk_late, w._lk_failed, w._lk_failing = [], [], set()
    w._lk_flow = PushFlow(w._reqs_to_send, allowed=lambda host: True, hold_s=1.0, max_bytes=1 << 20,
                          drop=lambda *a: None)
    w.submitted = submitted
    return w


def test_a_write_is_submitted_for_a_live_lease_and_refused_once_the_reap_ended_it(worker):
    worker._xfer_blocks_for_req("live", None)
    assert worker.submitted == ["live"] and worker._lk_flow.take_refused() == []
    worker._lk_reaped(["old"])
    worker._xfer_blocks_for_req("old", None)
    assert worker.submitted == ["live"]  # never submitted: P may already have reused those blocks
    assert worker._lk_flow.take_refused() == ["old"]


def test_the_reap_holds_back_only_the_lease_being_submitted_and_never_waits_on_a_slow_submission(worker, monkeypatch):
    reaps: list[tuple] = []
    monkeypatch.setattr(PHooks, "_reap_expired_send_leases",
                        lambda self, done: reaps.append(self._lk_reap_hold()))
    entered, finish = threading.Event(), threading.Event()

    def slow_submit(self, req_id, meta):  # a WRITE submission that takes long (vLLM warns above 200 ms)
        entered.set()
        finish.wait(5)

    monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks_for_req", slow_submit)
    writer = threading.Thread(target=worker._xfer_blocks_for_req, args=("live", None))
    writer.start()
    assert entered.wait(5)
    started = time.perf_counter()
    worker._reap_expired_send_leases(set())  # the engine thread reaps while the writer is still submitting
    assert time.perf_counter() - started < 0.5
    assert reaps == [("live",)]  # everything else due is reaped on time; "live" at the next step
    finish.set()
    writer.join(5)
    worker._reap_expired_send_leases(set())
    assert reaps[-1] == () and not worker._lk_flow.write_lock.locked()


def test_a_chaos_writer_stall_sleeps_before_the_submission_and_is_reported(worker, tmp_path):
    path = str(tmp_path / "prefill.json")
    worker._lk_faults = FaultPoints(path)
    write_control(path, {"writer_stall_s": 0.2, "seq": 7})
    worker._lk_faults.poll()  # the engine thread loads the control each step
    started = time.perf_counter()
    worker._xfer_blocks_for_req("live", None)
    assert time.perf_counter() - started >= 0.2 and worker.submitted == ["live"]
    (stall,) = read_state(path)["writer_stalls"]
    assert stall["seconds"] >= 0.2
    worker._xfer_blocks_for_req("live", None)  # once per control
    assert time.perf_counter() - started < 0.2 + 0.15


def test_the_reap_judges_silence_up_to_the_writers_last_poll_waiting_at_most_e(worker):
    flow = worker._lk_flow
    flow.writer_batch({}, polled_at=100.0)
    flow.take_notifications()
    assert worker._lk_reap_now(100.5) == 100.0
    assert worker._lk_reap_now(110.0) == 106.0  # E = 4 at L = 6
    assert PHooks._lk_reap_now(worker, 110.0) == 110.0  # pull mode: the engine thread drains NIXL itself


def test_each_issued_write_gets_one_outcome_however_often_vllm_reports_its_failure(worker, monkeypatch):
    polls = iter([(set(), {"live"}), ({"live"}, {"live"}), ({"old"}, set()), ({"live"}, {"live"}), ({"live"}, {"live"})])
    monkeypatch.setattr(NixlPushConnectorWorker, "_pop_done_transfers", lambda self, transfers: next(polls), raising=False)
    worker._lk_gate = type("Gate", (), {"poll": staticmethod(lambda transfers, done, failed: (done, failed))})()  # D's read gate: pull only
    worker._reqs_to_process = set()
    worker._reqs_to_send.pop("old")  # its lease expired before its WRITE finished
    for _ in range(3):
        worker._pop_done_transfers(worker._sending_transfers)
    # vLLM reported "live" failing on two polls, then done (it keeps the lease until it expires): one failure, not late
    assert worker._lk_failed == ["live"] and worker._lk_late == ["old"]
    worker._pop_done_transfers({})  # not P's WRITEs: nothing noted
    assert worker._lk_failed == ["live"]
    worker._pop_done_transfers(worker._sending_transfers)  # a later WRITE under the same id fails: counted again
    assert worker._lk_failed == ["live", "live"] and not worker._lk_failing
