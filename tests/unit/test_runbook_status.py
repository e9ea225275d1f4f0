"""``leasekit status``: scrapes real HTTP servers on 127.0.0.1 serving real prometheus-client metrics
named and labelled as the catalog (leasekit.telemetry.metrics) declares."""

import argparse
import http.server
import json
import socket
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from leasekit.runbook import status
from leasekit.runbook.health import remote_label
from leasekit.runbook.promscrape import Sample, counter_deltas, metrics_url
from leasekit.telemetry import metrics as m

ENGINE = {"model_name": "tiny", "engine": "0"}


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="leasekit")
    status.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


class MetricsServer:
    """A real /metrics endpoint: a private registry holding every catalog metric (optionally only
    vLLM's), served by prometheus-client's own HTTP server."""

    def __init__(self, *, leasekit=True, vllm=True):
        self.registry = CollectorRegistry()
        self.metrics = {}
        if leasekit:
            for spec in m.LEASEKIT_METRICS:
                labels = m.VLLM_ENGINE_LABELS + spec.labels
                cls = {"counter": Counter, "gauge": Gauge}.get(spec.kind)
                if cls is None:
                    self.metrics[spec.name] = Histogram(spec.name, spec.help, labels, buckets=spec.buckets,
                                                        registry=self.registry)
                else:
                    self.metrics[spec.name] = cls(spec.name, spec.help, labels, registry=self.registry)
        if vllm:
            for name, kind in m.VLLM_NIXL_METRICS.items():
                cls = Counter if kind == "counter" else Histogram
                self.metrics[name] = cls(name, name, list(m.VLLM_ENGINE_LABELS), registry=self.registry)
                if kind == "counter":
                    self.metrics[name].labels(**ENGINE)  # vLLM creates its per-engine children at start
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def config(self, role, L, H, E, engine="0"):
        for spec, value in ((m.DURATION, L), (m.HEARTBEAT_INTERVAL, H), (m.EXTENSION, E)):
            self.metrics[spec.name].labels(model_name="tiny", engine=engine, kv_role=role).set(value)

    def get(self, spec, remote=None, **labels):
        """The child of ``spec`` for ``labels``; ``remote`` fills the catalog's remote-peer label."""
        if remote is not None:
            labels[remote_label(spec)] = remote
        return self.metrics[spec.name].labels(**{**ENGINE, **labels})

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    made = []

    def make(**kwargs):
        made.append(MetricsServer(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def healthy_p(make):
    p = make()
    p.config("kv_producer", 6, 1, 4)
    p.get(m.GRANTS, tp_rank="0").inc(5)
    p.get(m.RELEASES, tp_rank="0").inc(5)
    p.get(m.EXTENSIONS, tp_rank="0").inc(7)
    p.get(m.LEASES_ACTIVE, tp_rank="0").set(0)
    return p


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_url_accepts_host_port_base_and_full_urls():
    assert metrics_url("127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://h:8000/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/metrics") == "http://h:8000/metrics"
    assert metrics_url("https://h/metrics/") == "https://h/metrics"
    assert metrics_url("[::1]:8000") == "http://[::1]:8000/metrics"


@pytest.mark.parametrize("url", ["http://[::1", "", "   ", "not a url at all", "ftp://h:1", "h:99999", "http://:80"])
def test_a_url_that_is_no_server_address_is_a_usage_error_naming_it(url, capsys):
    with pytest.raises(ValueError, match="server URL"):
        metrics_url(url)
    assert run_cli(["status", url]) == 2
    err = capsys.readouterr().err
    assert "server URL" in err and "host:port" in err and "Traceback" not in err


def test_ok_server_reports_config_totals_and_exit_0(servers, capsys):
    p = healthy_p(servers)
    assert run_cli(["status", p.url, "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (s,) = report["servers"]
    assert report["verdict"] == "OK" and report["mode"] == "totals"
    assert s["url"] == p.url + "/metrics" and s["verdict"] == "OK" and s["reasons"] == []
    assert s["config"] == {"kv_roles": ["kv_producer"], "lease_duration_s": 6, "heartbeat_interval_s": 1,
                           "extension_s": 4}
    assert s["counters"]["grants"] == 5 and s["counters"]["releases"] == 5 and s["counters"]["extensions"] == 7
    assert s["counters"]["expiries"] == 0 and s["counters"]["vllm:nixl_num_kv_expired_reqs"] == 0
    assert s["gauges"]["leases_active"] == 0
    assert s["notes"] == [] and s["error"] is None


def test_expiries_expiring_soon_and_heartbeat_failures_are_degraded(servers, capsys):
    p = healthy_p(servers)
    p.get(m.EXPIRIES, tp_rank="0", cause="no_heartbeat", peer_state="unknown").inc()
    p.get(m.EXPIRIES, tp_rank="0", cause="heartbeat_lapsed", peer_state="silent").inc(2)
    p.get(m.EXPIRED_PEER_RETURNS, tp_rank="0").inc(2)
    p.get(m.EXPIRING_SOON, tp_rank="0").set(1)
    d = servers()
    d.config("kv_consumer", 6, 1, 4)
    d.get(m.HEARTBEATS_SENT, tp_rank="0", remote="P1").inc(40)
    d.get(m.HEARTBEAT_SEND_FAILURES, tp_rank="0", remote="P1").inc(3)
    assert run_cli(["status", p.url, d.url + "/metrics", "-o", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    ps, ds = report["servers"]
    assert report["verdict"] == "DEGRADED"
    assert ps["verdict"] == "DEGRADED" and ps["counters"]["expiries"] == 3
    assert ps["breakdown"]["expiries_by_cause"] == {"heartbeat_lapsed": 2, "no_heartbeat": 1}
    assert ps["breakdown"]["expiries_by_peer_state"] == {"silent": 2, "unknown": 1}
    assert ps["counters"]["expired_peer_returns"] == 2
    assert any("3 lease expiries since start (by cause: heartbeat_lapsed=2, no_heartbeat=1; by D state at the "
               "reap: silent=2, unknown=1; 2 of a silent D that came back: stalled, not dead)" in r
               for r in ps["reasons"])
    assert any("1 lease(s) expiring soon" in r for r in ps["reasons"])
    assert ds["verdict"] == "DEGRADED" and ds["config"]["kv_roles"] == ["kv_consumer"]
    assert ds["counters"]["heartbeats_sent"] == 40 and ds["counters"]["heartbeat_send_failures"] == 3
    assert ds["breakdown"][f"heartbeat_send_failures_by_{remote_label(m.HEARTBEAT_SEND_FAILURES)}"] == {"P1": 3}


def test_late_completion_is_critical_in_table_and_json(servers, capsys):
    p = healthy_p(servers)
    p.get(m.LATE_COMPLETIONS, tp_rank="0", fail_closed="false").inc()
    p.get(m.EXPIRIES, tp_rank="0", cause="heartbeat_lapsed", peer_state="silent").inc()
    assert run_cli(["status", p.url]) == 1
    out = capsys.readouterr().out
    assert "CRITICAL because:" in out
    assert (f"  - 1 late completion(s) since start from D agents that do not fail closed (all late completions by "
            f"tp_rank: 0=1)") in out
    assert "overall: CRITICAL" in out and "late completions" in out
    report = status.collect_status([p.url])
    assert report["servers"][0]["verdict"] == "CRITICAL"
    assert report["servers"][0]["reasons"][0].startswith("1 late completion(s)")
    assert any("1 lease expiry since start" in r for r in report["servers"][0]["reasons"])  # degraded findings kept too


def test_late_completions_a_fail_closed_d_discarded_are_degraded_not_critical(servers, capsys):
    p = healthy_p(servers)
    p.get(m.LATE_COMPLETIONS, tp_rank="0", fail_closed="true").inc(2)
    p.metrics["vllm:nixl_num_notifications_after_expiry"].labels(**ENGINE).inc(2)  # vLLM counts them too
    (s,) = status.collect_status([p.url])["servers"]
    assert s["verdict"] == "DEGRADED", s["reasons"]
    assert any(r.startswith("2 late completion(s) since start from fail-closed D agents") for r in s["reasons"])
    # one more late read, from a D that does not fail closed: vLLM's count now exceeds the discarded ones
    p.metrics["vllm:nixl_num_notifications_after_expiry"].labels(**ENGINE).inc()
    (s,) = status.collect_status([p.url])["servers"]
    assert s["verdict"] == "CRITICAL"
    assert any(r.startswith("vllm:nixl_num_notifications_after_expiry = 3") for r in s["reasons"])


def test_unreachable_server_is_named_and_others_still_reported(servers, capsys):
    p = healthy_p(servers)
    dead = f"http://127.0.0.1:{closed_port()}"
    assert run_cli(["status", dead, p.url, "-o", "json", "--timeout", "2"]) == 3
    report = json.loads(capsys.readouterr().out)
    bad, good = report["servers"]
    assert bad["verdict"] == "UNREACHABLE" and good["verdict"] == "OK"
    assert bad["error"].startswith(f"could not scrape {dead}/metrics: ConnectError")
    assert report["verdict"] == "UNKNOWN"
    # a known problem elsewhere outranks the unknown
    p.get(m.LATE_COMPLETIONS, tp_rank="0", fail_closed="false").inc()
    assert run_cli(["status", dead, p.url, "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert f"{dead}/metrics: UNREACHABLE: could not scrape" in out


def test_stock_nixl_server_has_no_lease_metrics(servers, capsys):
    stock = servers(leasekit=False)
    stock.metrics["vllm:nixl_num_kv_expired_reqs"].labels(**ENGINE).inc(2)
    assert run_cli(["status", stock.url, "-o", "json"]) == 3
    (s,) = json.loads(capsys.readouterr().out)["servers"]
    assert s["verdict"] == "NO_LEASE_METRICS"
    assert "stock NixlConnector" in s["reasons"][0]
    assert "vllm:nixl_num_kv_expired_reqs = 2 since start" in s["reasons"]
    assert s["counters"]["vllm:nixl_num_kv_expired_reqs"] == 2 and s["counters"]["grants"] == 0
    # a stock P that served reads after expiry is CRITICAL, not merely "no lease metrics"
    stock.metrics["vllm:nixl_num_notifications_after_expiry"].labels(**ENGINE).inc()
    assert run_cli(["status", stock.url, "-o", "json"]) == 1
    (s,) = json.loads(capsys.readouterr().out)["servers"]
    assert s["verdict"] == "CRITICAL" and "stock NixlConnector" in s["reasons"][0]
    bare = servers(leasekit=False, vllm=False)
    Gauge("vllm:num_requests_running", "x", registry=bare.registry).set(0)
    (s,) = status.collect_status([bare.url])["servers"]
    assert s["verdict"] == "NO_LEASE_METRICS" and "not a NIXL P/D server" in s["reasons"][0]


def test_fresh_leasekit_server_declares_its_metrics_before_any_lease(servers):
    fresh = servers()  # every catalog family declared, no child yet (nothing recorded)
    (s,) = status.collect_status([fresh.url])["servers"]
    assert s["verdict"] == "OK" and s["counters"]["grants"] == 0 and s["config"]["kv_roles"] == []
    assert s["notes"] == ["leasekit metrics are declared but have no samples yet: no lease recorded since start"]


def test_rank_max_per_engine_summed_with_per_rank_rows(servers, capsys):
    p = servers()
    for engine in ("0", "1"):
        p.config("kv_producer", 30, 5, 20, engine=engine)
    for engine, rank, active, blocks in (("0", "0", 2, 16), ("0", "1", 3, 24), ("1", "0", 1, 8)):
        p.metrics[m.LEASES_ACTIVE.name].labels(model_name="tiny", engine=engine, tp_rank=rank).set(active)
        p.metrics[m.PINNED_BLOCKS.name].labels(model_name="tiny", engine=engine, tp_rank=rank).set(blocks)
        p.metrics[m.GRANTS.name].labels(model_name="tiny", engine=engine, tp_rank=rank).inc(10)
    assert run_cli(["status", p.url, "-o", "json"]) == 0
    (s,) = json.loads(capsys.readouterr().out)["servers"]
    # gauges: sum over engines of the max over ranks (3 + 1, 24 + 8), as the dashboard and alert
    assert s["gauges"]["leases_active"] == 4 and s["gauges"]["pinned_blocks"] == 32
    assert s["counters"]["grants"] == 30
    assert s["config"]["lease_duration_s"] == 30 and s["config"]["extension_s"] == 20
    assert [(r["engine"], r["tp_rank"], r["leases_active"], r["pinned_blocks"], r["grants"]) for r in s["ranks"]] == [
        ("0", "0", 2, 16, 10), ("0", "1", 3, 24, 10), ("1", "0", 1, 8, 10)]
    assert run_cli(["status", p.url]) == 0
    out = capsys.readouterr().out
    assert "per rank" in out and "pinned KV blocks" in out


def test_interval_reports_increases_and_the_verdict_uses_them(servers, capsys):
    p = healthy_p(servers)
    p.get(m.EXPIRIES, tp_rank="0", cause="no_heartbeat", peer_state="unknown").inc(4)  # an old incident
    p.get(m.LATE_COMPLETIONS, tp_rank="0", fail_closed="false").inc()
    assert status.collect_status([p.url])["servers"][0]["verdict"] == "CRITICAL"

    def traffic(seconds):  # what the server does between the scrapes
        p.get(m.GRANTS, tp_rank="0").inc(4)
        p.get(m.RELEASES, tp_rank="0").inc(4)

    report = status.collect_status([p.url], interval_s=10, sleep=traffic)
    (s,) = report["servers"]
    assert report["mode"] == "interval" and report["interval_s"] == 10
    assert s["verdict"] == "OK" and s["reasons"] == []
    assert s["counters"]["grants"] == 4 and s["counters"]["expiries"] == 0 and s["counters"]["late_completions"] == 0
    assert s["rates_per_s"]["grants"] == pytest.approx(4 / s["elapsed_s"])
    assert s["counter_resets"] == 0

    def expiring(seconds):
        p.get(m.EXPIRIES, tp_rank="0", cause="heartbeat_lapsed", peer_state="silent").inc()  # a new series

    (s,) = status.collect_status([p.url], interval_s=10, sleep=expiring)["servers"]
    assert s["verdict"] == "DEGRADED" and s["counters"]["expiries"] == 1
    assert s["breakdown"]["expiries_by_peer_state"] == {"silent": 1, "unknown": 0}
    assert "in the last" in s["reasons"][0]
    # the real CLI path: two scrapes 0.2 s apart
    assert run_cli(["status", p.url, "--interval", "0.2", "-o", "json"]) == 0
    (s,) = json.loads(capsys.readouterr().out)["servers"]
    assert 0.2 <= s["elapsed_s"] < 5 and s["counters"]["grants"] == 0


def test_counter_deltas_treat_a_decrease_as_a_reset():
    name = m.GRANTS.sample_names[0]
    before = [Sample(name, {"tp_rank": "0"}, 10.0), Sample(m.LEASES_ACTIVE.name, {"tp_rank": "0"}, 5.0)]
    after = [Sample(name, {"tp_rank": "0"}, 3.0), Sample(m.LEASES_ACTIVE.name, {"tp_rank": "0"}, 2.0)]
    deltas, resets = counter_deltas(before, after)
    assert resets == 1 and [s.value for s in deltas] == [3.0, 2.0]


def test_json_keys_are_stable_for_every_verdict(servers, capsys):
    p = healthy_p(servers)
    stock = servers(leasekit=False)
    dead = f"http://127.0.0.1:{closed_port()}"
    run_cli(["status", p.url, stock.url, dead, "-o", "json", "--timeout", "2"])
    report = json.loads(capsys.readouterr().out)
    assert list(report) == ["mode", "interval_s", "verdict", "servers"]
    keys = [list(s) for s in report["servers"]]
    assert keys[0] == keys[1] == keys[2] == [
        "url", "verdict", "reasons", "error", "notes", "config", "gauges", "counters", "breakdown", "listener",
        "elapsed_s", "rates_per_s", "counter_resets", "ranks"]
    assert list(report["servers"][0]["counters"]) == list(report["servers"][2]["counters"])
    assert [s["verdict"] for s in report["servers"]] == ["OK", "NO_LEASE_METRICS", "UNREACHABLE"]


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            body = b"this is { not prometheus text\n"
            self.send_response(200)
        else:
            body = b"nope"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_http_errors_and_unparsable_bodies_exit_3():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        report = status.collect_status([base, base + "/other"])
        garbage, missing = report["servers"]
        assert garbage["verdict"] == "UNKNOWN" and "answered but not with Prometheus text" in garbage["error"]
        assert missing["verdict"] == "UNREACHABLE" and "HTTP 404" in missing["error"]
        assert status.exit_code(report) == 3
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("argv", [["status"], ["status", "h:1", "--interval", "0"],
                                  ["status", "h:1", "--timeout", "nan"], ["status", "h:1", "-o", "yaml"]])
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        run_cli(argv)
    assert info.value.code == 2


def test_handshake_listener_down_is_critical_and_bad_requests_degraded(servers, capsys):
    p = healthy_p(servers)
    p.get(m.HANDSHAKE_LISTENER_UP).set(1)
    p.get(m.HANDSHAKE_REQUESTS).inc(4)
    for reason in m.HANDSHAKE_BAD_REASONS:
        p.get(m.HANDSHAKE_BAD_REQUESTS, reason=reason)  # exported at 0, as the connector does
    assert run_cli(["status", p.url, "-o", "json"]) == 0
    (ok,) = json.loads(capsys.readouterr().out)["servers"]
    assert ok["verdict"] == "OK" and ok["listener"] == {"up": 1, "down_engines": []}
    assert ok["counters"]["handshake_requests"] == 4 and ok["counters"]["handshake_bad_requests"] == 0
    assert ok["breakdown"]["handshake_bad_requests_by_reason"] == {}  # zero reasons left out

    p.get(m.HANDSHAKE_BAD_REQUESTS, reason="unknown_rank").inc(2)
    p.get(m.HANDSHAKE_BAD_REQUESTS, reason="bad_msgpack").inc()
    assert run_cli(["status", p.url, "-o", "json"]) == 1
    (degraded,) = json.loads(capsys.readouterr().out)["servers"]
    assert degraded["verdict"] == "DEGRADED" and degraded["counters"]["handshake_bad_requests"] == 3
    assert degraded["breakdown"]["handshake_bad_requests_by_reason"] == {"bad_msgpack": 1, "unknown_rank": 2}
    assert any("3 malformed handshake request(s) refused since start (by reason: bad_msgpack=1, unknown_rank=2)"
               in r for r in degraded["reasons"])

    p.get(m.HANDSHAKE_LISTENER_UP).set(0)
    assert run_cli(["status", p.url]) == 1
    out = capsys.readouterr().out
    assert "CRITICAL because:" in out and "NIXL handshake listener down (engine 0): no new D engine can connect" in out
    assert "DOWN (engine 0)" in out and "bad handshake requests" in out and "unknown_rank=2" in out


def test_listener_unknown_when_not_exported(servers, capsys):
    d = servers()
    d.config("kv_consumer", 6, 1, 4)
    assert run_cli(["status", d.url, "-o", "json"]) == 0
    (s,) = json.loads(capsys.readouterr().out)["servers"]
    assert s["listener"] == {"up": None, "down_engines": []} and s["verdict"] == "OK"


def test_a_trickling_or_huge_metrics_answer_is_an_error_within_the_timeout(monkeypatch):
    import http.server
    import time
    import threading

    import leasekit.runbook.promscrape as promscrape

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            if self.path.startswith("/slow"):
                for _ in range(40):  # 8 s of trickle, one line every 0.2 s
                    self.wfile.write(b"# HELP x y\n")
                    self.wfile.flush()
                    time.sleep(0.2)
            else:
                self.wfile.write(b"# HELP x y\n" * 500)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        started = time.monotonic()
        slow = promscrape.scrape(base + "/slow/metrics", timeout_s=1.0)
        assert slow.error and "took more than 1 s" in slow.error and time.monotonic() - started < 3
        monkeypatch.setattr(promscrape, "MAX_METRICS_BYTES", 1000)
        huge = promscrape.scrape(base + "/metrics", timeout_s=5.0)
        assert huge.error and "larger than 1000 bytes" in huge.error
    finally:
        server.shutdown()
