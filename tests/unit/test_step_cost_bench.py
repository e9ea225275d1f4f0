"""The builders and drivers of ``benchmarks/step_cost.py`` (``benchmarks/pstep/``) at tiny N: the stock
and LeaseKit workers they build really hold the leases, handle D's notifications and send D's
heartbeats through the production code paths. No timing is asserted.

Needs vLLM (CPU) and LeaseKit's connector; fails without them unless ``LEASEKIT_SKIP_PAIR=1``.
"""

from __future__ import annotations

import time

import pytest

from benchmarks.pstep import build as B
from benchmarks.pstep import drive as D
from benchmarks.pstep import measure as M
from benchmarks.pstep import report as R
from leasekit.cluster.model import write_tiny_llama

N = 50
STEPS = 5


@pytest.fixture(scope="module")
def v(vllm_available):
    return B.load_vllm()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _sides(v, cls, model_dir, tmp_path):
    return [cls(v, R.STOCK, leasekit=False, model_dir=model_dir, run_dir=None),
            cls(v, R.LEASEKIT, leasekit=True, model_dir=model_dir, run_dir=str(tmp_path / "on")),
            cls(v, R.LEASEKIT_OFF, leasekit=True, export=False, model_dir=model_dir, run_dir=str(tmp_path / "off"))]


@pytest.fixture
def p_sides(v, model_dir, tmp_path):
    sides = _sides(v, D.PSide, model_dir, tmp_path)
    yield sides
    for side in sides:
        side.connector.shutdown()


@pytest.fixture
def d_sides(v, model_dir, tmp_path):
    sides = _sides(v, D.DSide, model_dir, tmp_path)
    yield sides
    for side in sides:
        side.connector.shutdown()


def test_builders_make_the_production_classes(v, p_sides):
    stock, leasekit, off = p_sides
    assert type(stock.worker) is v.pull_worker.NixlPullConnectorWorker
    assert type(leasekit.worker) is v.leasekit.LeaseKitPullWorker and type(off.worker) is v.leasekit.LeaseKitPullWorker
    assert type(stock.connector) is v.connector.NixlPullConnector
    assert type(leasekit.connector) is v.leasekit.LeaseKitConnector
    assert all(side.connector.connector_worker is side.worker for side in p_sides)


def test_grants_put_n_leases_live_on_every_worker(p_sides):
    ids = [D.request_id(i) for i in range(N)]
    for side in p_sides:
        assert side.grant(ids, batch=20, age_s=side.age_s) == 0, side.label
        assert set(side.live) == set(ids), side.label  # vLLM's _reqs_to_send
        now = time.perf_counter()
        # aged by L - E = 10 s at the grant: about E = 20 s left, never more than L
        assert all(now + 15 < deadline <= now + B.LEASE_DURATION_S for deadline in side.live.values()), side.label


def test_heartbeat_extends_and_completion_releases_one_lease(p_sides):
    ids = [D.request_id(i) for i in range(N)]
    for side in p_sides:
        side.grant(ids, batch=N, age_s=side.age_s)
        before = dict(side.live)
        time.sleep(0.01)  # the heartbeat's now + E is later than every deadline
        side.deliver([D.heartbeat(ids[1:17]), D.completion(ids[0])])
        results = D.engine_step(side.connector, side.metadata())
        assert set(results.finished_sending) == {ids[0]}, side.label
        assert ids[0] not in side.live and len(side.live) == N - 1, side.label
        assert all(side.live[i] > before[i] for i in ids[1:17]), side.label
        assert all(side.live[i] == before[i] for i in ids[17:]), side.label


def test_timed_steps_expire_nothing_and_keep_n_live(p_sides):
    driver = M.PDriver(p_sides, N, batch=20)
    for side in p_sides:
        driver.empty_block(side, STEPS)
        driver.notif_block(side, STEPS)
        samples = driver.samples[side.label]
        assert samples.unexpected == 0, side.label
        assert len(samples.empty) == STEPS and len(samples.notif) == STEPS, side.label
        assert len(side.live) == N, side.label  # each completed lease was replaced by a new grant
        assert not {D.request_id(r) for r in range(STEPS)} & set(side.live), side.label
        assert {D.request_id(N + r) for r in range(STEPS)} <= set(side.live), side.label


def test_keep_alive_heartbeats_every_live_lease(p_sides):
    driver = M.PDriver(p_sides, N, batch=N)
    for side in p_sides:
        before = dict(side.live)
        driver.refreshed[side.label] = float("-inf")  # due
        driver.keep_alive(side)
        assert driver.samples[side.label].unexpected == 0
        assert all(side.live[i] > before[i] for i in before), side.label


def test_d_heartbeat_step_names_every_tracked_request(d_sides):
    driver = M.DDriver(d_sides, N, batch=20)
    wanted = {D.request_id(i) for i in range(1, N + 1)}  # the P request ids D's requests wait on
    for side in d_sides:
        driver.block(side, STEPS, 2)
        samples = driver.samples[side.label]
        assert samples.unexpected == 0 and len(samples.heartbeat) == 2, side.label
        beats = [msg for agent, msg in side.wrapper.sent if agent == B.P_AGENT and msg.startswith(b"HB:")]
        assert beats, side.label
        assert wanted <= set(beats[-1][3:].decode().split(",")), side.label


def test_memory_per_lease_counts_live_leases(v, model_dir, tmp_path):
    side = D.PSide(v, R.STOCK, leasekit=False, model_dir=model_dir, run_dir=None)
    result = M.memory_per_lease(side, N, heartbeats_each=2, per_step=2)
    assert result["live"] == N and result["unexpected_releases"] == 0
    assert result["bytes_per_lease_granted"] > 0 and result["bytes_per_lease_after_heartbeats"] > 0


def test_goals_verdicts():
    def side(empty, notif=50.0, unexpected=0):
        return {"empty_us": empty, "notif_minus_empty_us": notif, "unexpected_releases": unexpected}

    result = {"p": [{"n": 1_000, R.STOCK: side(10), R.LEASEKIT: side(14)},
                    {"n": 10_000, R.STOCK: side(10), R.LEASEKIT: side(11, notif=150)},
                    {"n": 100_000, R.STOCK: side(10), R.LEASEKIT: side(9, unexpected=1)}],
              "memory": {R.LEASEKIT: {"n": 10_000, "heartbeats_each": 64, "bytes_per_lease_after_heartbeats": 900.0,
                                      "unexpected_releases": 0}}}
    verdicts = [g["verdict"] for g in R.goals(result)]
    # 1k 1.4x <= 1.5 PASS; 10k 1.1x > 1.0 FAIL; 100k lost a lease INVALID; scaling INVALID;
    # notification 50 PASS, 150 FAIL, INVALID; memory 900 B PASS
    assert verdicts == ["PASS", "FAIL", "INVALID", "INVALID", "PASS", "FAIL", "INVALID", "PASS"]


def test_a_frozen_span_file_blocks_only_the_exporter_and_its_spans_are_counted(v, model_dir, tmp_path):
    """The frozen sink of ``benchmarks/pstep/blocked.py``: the P worker's span file is a FIFO nobody
    reads. Every step still completes (the engine thread never waits for the sink), every lease is
    released as asked, and once the pipe and the export queue are full the spans are dropped and
    counted, on the frozen worker only."""
    from benchmarks.pstep import blocked as K

    with K.frozen_span_dir(tmp_path / "frozen") as fifo:
        normal = D.PSide(v, R.LEASEKIT, leasekit=True, model_dir=model_dir, run_dir=str(tmp_path / "normal"))
        frozen = D.PSide(v, R.LEASEKIT_BLOCKED, leasekit=True, model_dir=model_dir, run_dir=str(tmp_path / "frozen"))
        assert fifo.exists()
        driver = M.PDriver([normal, frozen], N)
        for side in (normal, frozen):
            driver.notif_block(side, 2600)  # 2600 spans > the pipe's 64 KiB + the 2048-span queue
            assert driver.samples[side.label].unexpected == 0 and len(side.live) == N
        deadline = time.monotonic() + 10
        while K.unexported(frozen.worker)["dropped"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # spans are built and queued on background threads
        assert K.unexported(frozen.worker)["dropped"] > 0
        assert K.unexported(normal.worker) == {"dropped": 0, "failed": 0}
        for side in (normal, frozen):
            side.connector.shutdown()
