"""The builders and drivers of ``benchmarks/step_cost.py`` (``benchmarks/pstep/``) at tiny N: the stock
and LeaseKit workers they build really hold the leases, handle D's notifications and send D's
heartbeats through the production code paths. No timing is asserted.

Needs vLLM (CPU) and LeaseKit's connector; fails without them unless ``LEASEKIT_SKIP_PAIR=1``.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from leasekit.lease.proof import split_tagged

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
        side.deliver([side.heartbeat(ids[1:17]), side.completion(ids[0])])  # what the matching D sends
        results = D.engine_step(side.connector, side.metadata())
        assert set(results.finished_sending) == {ids[0]}, side.label
        assert ids[0] not in side.live and len(side.live) == N - 1, side.label
        assert all(side.live[i] > before[i] for i in ids[1:17]), side.label
        assert all(side.live[i] == before[i] for i in ids[17:]), side.label
        if side.leasekit:  # the production path of a LeaseKit D: tagged ids, leases bound by proof
            assert split_tagged(side.heartbeat(ids[1:2])[3:].decode()) is not None
            assert all(side.worker._lk_p.keeping.binding.proven(i) for i in ids[1:17]), side.label


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
        named = {split_tagged(i)[0] if split_tagged(i) else i for i in beats[-1][3:].decode().split(",")}
        assert wanted <= named, side.label  # a LeaseKit D names each with its tag: <id>~<tag>


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


def _black_hole_sockets(port: int) -> list:
    """This process's TCP sockets on local port ``port`` (the black hole's listener and accepted ones)."""
    import psutil

    return [c for c in psutil.Process().net_connections(kind="tcp") if c.laddr and c.laddr.port == port]


def _black_hole_threads() -> list:
    import threading

    from benchmarks.pstep import blocked as K

    return [t for t in threading.enumerate() if t.name == K.BLACK_HOLE_THREAD]


def test_the_otlp_black_hole_accepts_never_answers_and_leaves_nothing_behind():
    import socket
    from urllib.parse import urlsplit

    from benchmarks.pstep import blocked as K

    with K.otlp_black_hole() as url:
        port = urlsplit(url).port
        assert urlsplit(url).hostname == "127.0.0.1" and port
        client = socket.create_connection(("127.0.0.1", port), timeout=2)
        client.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
        client.settimeout(0.3)
        with pytest.raises(socket.timeout):
            client.recv(1)  # no answer, no close
        assert len(_black_hole_threads()) == 1
        assert any(c.status == "LISTEN" for c in _black_hole_sockets(port))
    assert not _black_hole_threads() and not _black_hole_sockets(port)
    client.settimeout(2)
    try:  # closed by the black hole on exit: reset (it left our bytes unread) or end of stream
        assert client.recv(1) == b""
    except ConnectionResetError:
        pass
    client.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_the_otlp_side_is_built_with_its_endpoint_only_and_the_environment_is_restored(monkeypatch):
    import os

    from benchmarks.pstep import blocked as K

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user-collector:4318")  # the user's: not used
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # would override the protocol
    before = dict(os.environ)
    with B.telemetry_env(True, K.otlp_env("http://127.0.0.1:9", timeout_s=1.5)):
        assert os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:9"
        assert os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        assert os.environ["OTEL_EXPORTER_OTLP_TIMEOUT"] == "1.5"
        assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in os.environ
    assert os.environ == before
    with B.telemetry_env(True):
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in os.environ  # the other sides: OTLP off
    with pytest.raises(ValueError, match="timeout_s"):
        K.otlp_env("http://127.0.0.1:9", timeout_s=0)


def test_run_blocked_times_the_otlp_black_hole_side_and_counts_its_spans(v, model_dir, tmp_path, monkeypatch):
    """``step_cost.run_blocked`` at N = 50: the third side's worker exports by OTLP to a real endpoint
    that never answers (its first batch of 512 spans hangs, then fails), every step still completes, the
    result and the report have the side's median, ratio and counts, and afterwards nothing of the black
    hole is left (no thread, no socket) and the environment is as before."""
    import os
    from urllib.parse import urlsplit

    from benchmarks import step_cost as S
    from benchmarks.pstep import blocked as K

    urls, black_hole = [], K.otlp_black_hole

    @contextlib.contextmanager
    def recording(*a, **kw):
        with black_hole(*a, **kw) as url:
            urls.append(url)
            yield url

    monkeypatch.setattr(K, "otlp_black_hole", recording)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    otel = lambda: {k: x for k, x in os.environ.items() if k.startswith("OTEL_")}  # noqa: E731 (vLLM sets others)
    env, steps = otel(), 600  # > 512 spans: one full OTLP batch goes out during the run
    args = S.parse_args(["--blocked-n", str(N), "--blocked-steps", str(steps), "--rounds", "2",
                         "--blocked-otlp-timeout", "1"])
    entry = S.run_blocked(v, args, tmp_path, model_dir)

    otlp = entry[R.LEASEKIT_OTLP_BLOCKED]
    assert otlp["unexpected_releases"] == 0 and otlp["notif_n"] == steps
    assert all(entry[label]["settled"] for label in (R.LEASEKIT, R.LEASEKIT_BLOCKED, R.LEASEKIT_OTLP_BLOCKED))
    assert otlp["notif_us"] > 0 and entry[R.LEASEKIT]["notif_us"] > 0
    assert isinstance(otlp["dropped"], int) and isinstance(otlp["failed"], int)
    sink = otlp["sinks"]["otlp"]
    assert sink["ended"] == steps and sink["exported"] == 0  # nothing ever succeeds against the black hole
    assert sink["exporting"] + sink["failed"] >= 512  # the first full batch met the endpoint and hung
    assert set(entry[R.LEASEKIT_BLOCKED]) >= {"notif_us", "dropped", "failed"}

    goal = next(g for g in R.goals({"blocked": entry}) if "OTLP endpoint that never answers" in g["goal"])
    assert goal["value"] == pytest.approx(otlp["notif_us"] / entry[R.LEASEKIT]["notif_us"])
    assert goal["verdict"] in ("PASS", "FAIL")
    table = R.render({"blocked": entry})
    assert R.LEASEKIT_OTLP_BLOCKED in table and "timeout 1 s" in table

    assert len(urls) == 1
    port = urlsplit(urls[0]).port
    assert not _black_hole_threads() and not _black_hole_sockets(port)
    assert otel() == env


@pytest.mark.parametrize("argv,field", [(["--blocked-n", "-1"], "--blocked-n"), (["--memory-n", "x"], "--memory-n"),
                                        (["--blocked-steps", "0"], "--blocked-steps"),
                                        (["--memory-heartbeats", "-1"], "--memory-heartbeats"),
                                        (["--json", "/nonexistent-dir/x.json"], "--json")])
def test_bad_options_are_refused_before_the_run_naming_the_option(argv, field, capsys):
    from benchmarks import step_cost as S

    with pytest.raises(SystemExit) as exc:
        S.parse_args(argv)
    assert exc.value.code == 2 and field in capsys.readouterr().err
