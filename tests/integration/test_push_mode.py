"""Push mode on a real pair: vLLM's own NixlPushConnector on both sides (P WRITEs the prompt's KV blocks
into the blocks D registered, vllm ``nixl/push_worker.py``), the CPU build, routed as leasekit routes.

What these tests pin down:

- a push pair serves, and the KV blocks P wrote give D the same tokens as P computing the whole
  request itself (greedy, same dummy weights);
- it serves only because the router sends P and D one ``X-Request-Id``: P matches D's ``PUSH_REG``
  registration to its finished prefill by vLLM's request id with the random suffix stripped
  (``push_worker.py: _pop_matching_registration``); without a shared id no WRITE starts and D's
  request waits until the client gives up, heartbeating P's lease all the while (D registered and
  waits for a WRITE), and P reclaims the lease once D's heartbeats stop;
- stock P trusts a ``PUSH_REG``: a stranger who knows a request id makes P dial the stranger's address
  to WRITE the prompt's KV blocks there;
- a LeaseKit push pair (LeaseKitPushConnector on both sides) serves the same tokens as the stock push pair,
  its leases are spans and metrics with ``mode="push"`` (grant, WRITE issued, WRITE done, release), and its P
  refuses the stranger's registration and malformed ones, counted by reason, and keeps serving;
- a mixed push pair (LeaseKit P with a stock D, stock P with a LeaseKit D) serves the tokens of a local prefill.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest

from prometheus_client.parser import text_string_to_metric_families

from leasekit.chaos.peer import NixlPeer
from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.cluster.prometheus import PrometheusServer
from leasekit.cluster.serverspec import SERVED_MODEL_NAME
from leasekit.dashboards.checks import expression_modes, panel_queries
from leasekit.dashboards.promql import substitute_grafana_vars
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.spanfile import read_span_dir
from tests.prefetch import PREFETCH

pytestmark = pytest.mark.pair
ROOT = Path(__file__).resolve().parents[2]
L = 6
TOKENS = 8
SPEC = PairSpec.pinned(prefill_connector="stock", decode_connector="stock", transfer_mode="push", lease_duration_s=L,
                       lease_logging=True,  # P's lease lines at DEBUG: the evidence of a stock P
                       decode_kv_load_failure_policy="fail")  # a failed push is an error, never recomputed by D
LK_SPEC = PairSpec.pinned(prefill_connector="leasekit", decode_connector="leasekit", transfer_mode="push",
                          lease_duration_s=L, decode_kv_load_failure_policy="fail")
PREFETCH_PAIRS = [SPEC, LK_SPEC]
"""Started ahead in the background (tests/prefetch.py)."""


@pytest.fixture(scope="module")
def push_pair(vllm_available, tmp_path_factory):
    with PREFETCH.pair_for(SPEC, tmp_path_factory.mktemp("push") / "run") as started:
        yield started


@pytest.fixture(scope="module")
def lk_push_pair(vllm_available, tmp_path_factory):
    with PREFETCH.pair_for(LK_SPEC, tmp_path_factory.mktemp("lk-push") / "run") as started:
        yield started


def local_generation(pair: PDPair, prompt: list[int], max_tokens: int) -> list[int]:
    """P computes the whole request itself (no kv_transfer_params): the tokens a push must reproduce."""
    response = httpx.post(f"{pair.prefill.url}/v1/completions", timeout=120, json={
        "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text[:300]
    return response.json()["choices"][0]["token_ids"]


MIXED_SPECS = [PairSpec.pinned(prefill_connector=p, decode_connector=d, transfer_mode="push", lease_duration_s=L,
                               decode_kv_load_failure_policy="fail")
               for p, d in (("leasekit", "stock"), ("stock", "leasekit"))]


# first in the module: its pairs start before the module's shared pairs run (a running P takes a core)
@pytest.mark.parametrize("spec", MIXED_SPECS, ids=["leasekit-P-stock-D", "stock-P-leasekit-D"])
def test_a_mixed_push_pair_writes_the_kv_blocks_of_a_local_prefill(vllm_available, tmp_path, spec):
    """LeaseKitPushConnector speaks the stock push wire both ways: a LeaseKit D's registrations (which carry its
    request for lease-end notifications) are WRITEn by a stock P, a stock D is WRITEn by a LeaseKit P (and is never
    sent a lease-end notification, which it could not parse), with the tokens of a local prefill."""
    with PREFETCH.pair_for(spec, tmp_path / "run") as pair:
        for length in (32, 80):
            prompt = pair.prompt(length)
            routed = pair.router.generate(prompt, TOKENS)
            assert routed.prefill.ok, routed.prefill.error
            assert routed.decode is not None and routed.decode.ok, routed.decode and routed.decode.error
            assert routed.decode.token_ids == local_generation(pair, prompt, TOKENS)
        for log in (pair.prefill.log_path.read_text(errors="replace"), pair.decode.log_path.read_text(errors="replace")):
            assert "Releasing expired KV blocks" not in log  # P freed on its WRITE: nothing waited for a lease
            assert "LeaseKit: told D" not in log and "Unrecognized request" not in log


def test_push_pair_runs_vllms_push_connector(push_pair):
    config = push_pair.prefill.spec.kv_transfer_config(push_pair.run_dir)
    assert config["kv_connector"] == "NixlPushConnector"
    assert "push_worker.py" in push_pair.prefill.log_path.read_text(errors="replace")  # "nixl-push-writer thread started"


def test_pushed_kv_blocks_give_the_tokens_of_a_local_prefill(push_pair):
    for length in (32, 48, 80):  # 80 tokens: several KV blocks per request
        prompt = push_pair.prompt(length)
        routed = push_pair.router.generate(prompt, TOKENS)
        assert routed.prefill.ok, routed.prefill.error
        assert routed.prefill.kv_transfer_params["transfer_mode"] == "push"
        assert routed.decode is not None and routed.decode.ok, routed.decode and routed.decode.error
        assert routed.decode.token_ids == local_generation(push_pair, prompt, TOKENS)
        # P freed the blocks because its WRITE completed, not because the lease ran out
        rid = routed.prefill.request_id
        deadline = time.monotonic() + 10
        while (f"Finished sending KV transfer for request {rid}\n" not in (log := push_pair.prefill.log_path.read_text(errors="replace"))
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert f"Finished sending KV transfer for request {rid}\n" in log
        assert f"Releasing expired KV blocks for request {rid} " not in log


def test_without_a_shared_request_id_p_never_pushes(push_pair):
    prompt = push_pair.prompt(40)
    prefill = push_pair.router.prefill(prompt)
    assert prefill.ok, prefill.error
    # D gets its own X-Request-Id: its PUSH_REG names a request P never finished, so no WRITE comes
    stranded = push_pair.router.decode(prompt, prefill.kv_transfer_params, TOKENS, timeout_s=2 * L,
                                       traceparent=prefill.traceparent, routing_id=None)
    assert stranded.status == 0 and not stranded.ok, "D served a push request whose registration P could not match"
    gave_up = time.monotonic()
    rid = prefill.request_id
    # D registered and waits for a WRITE, heartbeating P's lease (H = 1 s) until the client gave up
    # and D aborted the request; P then reclaims the lease at the last heartbeat + E (+ a step)
    expired = f"Releasing expired KV blocks for request {rid} "
    while expired not in push_pair.prefill.log_path.read_text(errors="replace") and time.monotonic() < gave_up + 3 * L:
        time.sleep(0.25)
    log = push_pair.prefill.log_path.read_text(errors="replace")
    assert expired in log, f"P still holds the lease of {rid} {3 * L} s after D stopped waiting for it"
    assert log.count(f"Heartbeat extended lease for request {rid} ") >= L, "D did not heartbeat the lease it waited on"
    again = push_pair.router.generate(push_pair.prompt(40), TOKENS)  # the pair still serves routed requests
    assert again.decode is not None and again.decode.ok


def test_stock_p_dials_the_address_a_strangers_push_reg_names(push_pair):
    """vLLM's push mode takes a ``PUSH_REG`` as an identity: any NIXL peer that handshaked with P and
    knows a finished prefill's ``X-Request-Id`` (P matches ``cmpl-<X-Request-Id>-0`` with the random
    suffix stripped on both sides, so the suffix protects nothing) names its own engine, address and block ids, and P's writer dials that address to WRITE the
    prompt's KV blocks there (``push_worker.py``: ``_handle_push_reg_notif`` -> ``_do_start_push_kv``
    -> ``_ensure_handshake``). This pins the stock behaviour a LeaseKit push connector must refuse."""
    prefill = push_pair.router.prefill(push_pair.prompt(40))  # finished on P; D is never asked
    assert prefill.ok, prefill.error
    params = prefill.kv_transfer_params
    with socket.socket() as trap, NixlPeer() as stranger:
        trap.bind(("127.0.0.2", 0))  # an address P served no handshake to
        trap.listen(4)
        trap.settimeout(L)
        agent = stranger.handshake("127.0.0.1", push_pair.prefill.side_channel_port)
        registration = {
            "request_id": f"cmpl-{prefill.routing_id}-0", "decode_engine_id": f"stranger-{uuid.uuid4()}",
            "decode_host": "127.0.0.2", "decode_port": trap.getsockname()[1], "decode_tp_size": 1,
            "local_block_ids": [[1]], "remote_engine_id": params["remote_engine_id"],
            "remote_host": params["remote_host"], "remote_port": params["remote_port"],
            "remote_tp_size": params["tp_size"], "remote_pp_size": 1,
        }
        stranger.send(agent, b"PUSH_REG:" + msgspec.msgpack.encode(registration))
        connection, (peer_host, _) = trap.accept()  # socket.timeout here: P did not dial (the defect is gone)
        connection.close()
    assert peer_host == "127.0.0.1"
    again = push_pair.router.generate(push_pair.prompt(40), TOKENS)  # P survives its failed handshake
    assert again.decode is not None and again.decode.ok


# -- LeaseKitPushConnector -----------------------------------------------------------------------------------


def metric_samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample called ``name`` on a server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def wait_for(predicate, timeout_s: float, poke=None):
    """Poll ``predicate()`` every 0.25 s until true or ``timeout_s`` passed; ``poke()`` every 2 s (P ships its
    metrics at its engine steps). Returns the last value."""
    deadline = last = time.monotonic()
    deadline += timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        if poke is not None and time.monotonic() - last > 2:
            poke()
            last = time.monotonic()
        time.sleep(0.25)
    return value


def test_leasekit_push_pair_serves_the_tokens_of_the_stock_push_pair(push_pair, lk_push_pair):
    config = lk_push_pair.prefill.spec.kv_transfer_config(lk_push_pair.run_dir)
    assert config["kv_connector"] == "LeaseKitPushConnector"
    rids = []
    for length in (32, 80):
        prompt = lk_push_pair.prompt(length)
        leasekit = lk_push_pair.router.generate(prompt, TOKENS)
        stock = push_pair.router.generate(prompt, TOKENS)
        assert leasekit.decode is not None and leasekit.decode.ok, leasekit.decode and leasekit.decode.error
        assert stock.decode is not None and stock.decode.ok
        assert leasekit.prefill.kv_transfer_params["transfer_mode"] == "push"
        assert leasekit.decode.token_ids == stock.decode.token_ids == local_generation(lk_push_pair, prompt, TOKENS)
        rids.append(leasekit.prefill.request_id)

    def released():
        spans = {s.attributes.get(sc.REQUEST_ID): s for s in read_span_dir(lk_push_pair.span_dir).spans
                 if s.name == sc.LEASE_SPAN_NAME}
        return spans if all(r in spans for r in rids) else None

    spans = wait_for(released, 10)
    assert spans, f"no lease span for {rids}"
    for rid in rids:  # the lease ended because its WRITE finished, after P issued it
        span = spans[rid]
        assert span.attributes[sc.OUTCOME] == sc.OUTCOME_RELEASED, span.attributes
        assert span.resource["leasekit.transfer_mode"] == "push"
        issued = span.attributes["leasekit.push.write_issued_after_s"]
        assert 0 <= issued < L
        assert span.attributes["leasekit.push.decode_agent"].startswith("peer-")
        assert (span.attributes["leasekit.push.write_issued_monotonic_s"]
                <= span.attributes["leasekit.push.write_done_monotonic_s"])

    def pushed():
        done = [v for labels, v in metric_samples(lk_push_pair.prefill.url, "leasekit_kv_lease_push_writes_total")
                if labels["outcome"] == "done" and labels["mode"] == "push"]
        return sum(done) >= len(rids)

    assert wait_for(pushed, 15, poke=lambda: lk_push_pair.router.generate(lk_push_pair.prompt(24), 2))
    grants = metric_samples(lk_push_pair.prefill.url, "leasekit_kv_lease_grants_total")
    assert grants and all(labels["mode"] == "push" for labels, _ in grants)
    assert sum(v for _, v in grants) >= len(rids)
    beats = metric_samples(lk_push_pair.decode.url, "leasekit_kv_lease_heartbeats_sent_total")
    assert beats and all(labels["mode"] == "push" for labels, _ in beats)

    def d_reads():  # D read nothing: each WRITE it received is "pushed", never a stock P's "unprotected" read
        samples = metric_samples(lk_push_pair.decode.url, "leasekit_kv_lease_reads_total")
        reads = {labels["outcome"]: v for labels, v in samples if v}
        return reads if sum(reads.values()) >= len(rids) else None

    reads = wait_for(d_reads, 15, poke=lambda: lk_push_pair.router.generate(lk_push_pair.prompt(24), 2))
    assert reads and set(reads) == {"pushed"} and reads["pushed"] >= len(rids), reads


def _registration(prefill, request_id: str, host: str, port: int) -> dict:
    params = prefill.kv_transfer_params
    return {"request_id": request_id, "decode_engine_id": f"stranger-{uuid.uuid4()}", "decode_host": host,
            "decode_port": port, "decode_tp_size": 1, "local_block_ids": [[1]],
            "remote_engine_id": params["remote_engine_id"], "remote_host": params["remote_host"],
            "remote_port": params["remote_port"], "remote_tp_size": params["tp_size"], "remote_pp_size": 1}


def test_leasekit_p_refuses_strangers_and_malformed_push_regs_and_keeps_serving(lk_push_pair):
    """The registration the stock P dials (test above) makes a LeaseKit P dial nothing: 127.0.0.2 is no address
    P's handshake listener served. A registration for a request P holds no lease for, malformed ones (not
    msgpack, a string port, a bool TP size, no block ids) and junk notifications are counted by reason; P
    keeps serving. On one host every peer is 127.0.0.1, so the address rule cannot tell a stranger from D here
    (docs/security.md): the lease rule and the one-registration-per-lease rule still hold."""
    pair = lk_push_pair
    prefill = pair.router.prefill(pair.prompt(40))  # finished on P; D is never asked: P holds the lease
    assert prefill.ok, prefill.error
    with socket.socket() as trap, NixlPeer() as stranger:
        trap.bind(("127.0.0.2", 0))
        trap.listen(4)
        trap.settimeout(2 * L)
        agent = stranger.handshake("127.0.0.1", pair.prefill.side_channel_port)
        good = _registration(prefill, f"cmpl-{prefill.routing_id}-0", "127.0.0.2", trap.getsockname()[1])
        stranger.send(agent, b"PUSH_REG:" + msgspec.msgpack.encode(good))
        unknown = dict(good, request_id=f"cmpl-{uuid.uuid4().hex}-0", decode_host="127.0.0.1")
        stranger.send(agent, b"PUSH_REG:" + msgspec.msgpack.encode(unknown))
        for bad in (b"PUSH_REG:\xc1\xc1", msgspec.msgpack.encode(dict(good, decode_port="80")),
                    msgspec.msgpack.encode(dict(good, decode_tp_size=True)),
                    msgspec.msgpack.encode({k: v for k, v in good.items() if k != "local_block_ids"})):
            stranger.send(agent, bad if bad.startswith(b"PUSH_REG:") else b"PUSH_REG:" + bad)
        stranger.send(agent, b"no colon here")
        stranger.send(agent, b"\xff\xfe:1")
        with pytest.raises(socket.timeout):
            trap.accept()  # P never dialled the address the registration named

    def dropped():
        counts = {labels["reason"]: v for labels, v in metric_samples(
            pair.prefill.url, "leasekit_kv_lease_notifications_dropped_total") if v}
        return counts if {"push_reg_not_allowed", "push_reg_unknown_id", "bad_push_reg", "no_colon",
                          "not_utf8"} <= counts.keys() else None

    counts = wait_for(dropped, 20, poke=lambda: pair.router.generate(pair.prompt(24), 2))
    assert counts, metric_samples(pair.prefill.url, "leasekit_kv_lease_notifications_dropped_total")
    assert counts["bad_push_reg"] >= 4
    again = pair.router.generate(pair.prompt(40), TOKENS)  # P (and its writer thread) still serve
    assert again.decode is not None and again.decode.ok


def test_push_only_dashboard_panels_show_data_from_a_real_prometheus(lk_push_pair, tmp_path):
    """A real Prometheus scrapes the LeaseKit push pair while it serves: the dashboard's push-only panels (P's WRITEs by
    outcome, D's late WRITE notifications; a pull pair exports neither, see test_prometheus.py) return data, and the
    ``done`` WRITEs of the served requests show as a positive rate."""
    pair = lk_push_pair
    board = json.loads((ROOT / "dashboards" / "lease-health.json").read_text())
    queries = [(where, substitute_grafana_vars(expr, {"job": ".+", "instance": ".+", "__rate_interval": "30s"}))
               for where, expr in panel_queries(board) if expression_modes(expr) == {"push"}]
    assert queries, "the dashboard has no push-only panel"
    host = lambda server: server.url.removeprefix("http://")  # noqa: E731
    with PrometheusServer(tmp_path / "prometheus", {"vllm-prefill": [host(pair.prefill)],
                                                   "vllm-decode": [host(pair.decode)]}) as prom:
        assert prom.wait_for(lambda: set(prom.targets_up().values()) == {"up"}, 30), prom.targets_up()
        t0 = time.time()
        for _ in range(3):
            served = pair.router.generate(pair.prompt(32), 2)
            assert served.decode is not None and served.decode.ok
            time.sleep(1.5)
        done_rate = 'sum(rate(leasekit_kv_lease_push_writes_total{outcome="done", mode="push"}[30s]))'
        assert prom.wait_for(lambda: (r := prom.query(done_rate)) and float(r[0]["value"][1]) > 0, 30), \
            prom.query("leasekit_kv_lease_push_writes_total")
        empty = [f"{where}: {expr}" for where, expr in queries if not prom.query_range(expr, t0, time.time(), 1.0)]
    assert not empty, "push-only panel queries without data:\n" + "\n".join(empty)

