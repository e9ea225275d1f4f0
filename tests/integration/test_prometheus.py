"""A real Prometheus scraping a real P/D pair through a kill-decode run.

Requests wait in D's queue (heartbeated leases on P), ``leasekit status`` shows the pinned blocks,
D is killed with SIGKILL, P reclaims, ``leasekit status`` shows the expiries, the expiry alert fires
in Prometheus, every panel query of the committed dashboard returns data, and ``leasekit explain``
prints the lease timeline of one of the requests. vLLM's request tracing is on (exported to a real
OTLP receiver), so a normally served request's ``traceparent`` from the router reaches both
servers: vLLM's own request spans and LeaseKit's P and D spans for it share one trace.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leasekit.chaos.workload import QueuedDecodeLoad
from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.cluster.prometheus import PrometheusServer
from leasekit.dashboards.checks import expression_modes
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.spanfile import read_span_dir
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.pair
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "lease-health.json"
RULES = ROOT / "dashboards" / "leasekit-rules.yml"
L = 6
EXPIRY_ALERT = "LeaseExpiries"
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$instance": ".+", "$job": ".+"}


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included, Grafana variables
    replaced by what Grafana would send for "All" over a 1 s scrape interval."""
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unsubstituted variable in {panel['title']!r}: {expr}"
            out.append((panel["title"], expr))
    return out


def leasekit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leasekit.cli", *args], capture_output=True, text=True, timeout=120)


def status(url: str) -> dict:
    done = leasekit("status", url, "-o", "json")
    assert done.returncode in (0, 1), done.stderr
    (server,) = json.loads(done.stdout)["servers"]
    return server


@pytest.fixture(scope="module")
def observed_run(vllm_available, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("prometheus-kill-decode")
    with OtlpReceiver() as otlp, PDPair(
        PairSpec.pinned(lease_duration_s=L, otlp_traces_endpoint=otlp.url + "/v1/traces"), run_dir / "pair"
    ) as pair:
        host = lambda server: server.url.removeprefix("http://")  # noqa: E731
        targets = {"vllm-prefill": [host(pair.prefill)], "vllm-decode": [host(pair.decode)]}
        with PrometheusServer(run_dir / "prometheus", targets, rule_files=[RULES]) as prom:
            assert prom.wait_for(lambda: set(prom.targets_up().values()) == {"up"}, 30), prom.targets_up()
            t0 = time.time()
            served = pair.router.generate(pair.prompt(), 2)  # one request read and released normally
            assert served.decode is not None and served.decode.ok, served
            load = QueuedDecodeLoad(pair, requests=3)
            load.start()
            time.sleep(2 * L // 6 + 1)  # a few heartbeats delivered and scraped
            before = status(pair.prefill.url)
            killed_at = time.time()
            pair.decode.kill(signal.SIGKILL)
            load.release_slot()
            # reclaim within max(grant + L, last heartbeat + E) + tick, then a scrape
            assert prom.wait_for(
                lambda: prom.query("sum(leasekit_kv_lease_expiries_total)")[0]["value"][1] == "3", 30
            ), "P's expiries never reached Prometheus"
            after = status(pair.prefill.url)
            fired = prom.wait_for(
                lambda: any(a["labels"]["alertname"] == EXPIRY_ALERT and a["state"] == "firing" for a in prom.alerts()),
                60,
            )
            alerts = prom.alerts()
            panels = [
                (title, expr, prom.query_range(expr, t0, time.time(), 1.0)) for title, expr in
                panel_queries(json.loads(DASHBOARD.read_text()))
            ]
            rules = prom.rule_groups()
            yield {
                "pair": pair, "load": load, "served": served, "otlp": otlp, "before": before, "after": after, "fired": fired, "alerts": alerts,
                "panels": panels, "rules": rules, "killed_at": killed_at,
            }


def test_status_shows_pinned_blocks_then_expiries(observed_run):
    before, after = observed_run["before"], observed_run["after"]
    assert before["gauges"]["pinned_blocks"] >= 3 and before["gauges"]["leases_active"] == 3, before
    assert before["counters"]["expiries"] == 0 and before["verdict"] == "OK", before
    assert before["counters"]["grants"] >= 5 and before["counters"]["releases"] >= 2, before  # warm-up, served
    assert after["gauges"]["leases_active"] == 0 and after["gauges"]["pinned_blocks"] == 0, after
    assert after["counters"]["expiries"] == 3 and after["verdict"] == "DEGRADED", after
    assert after["breakdown"]["expiries_by_cause"].get("heartbeat_lapsed") == 3, after


def test_expiry_alert_fires_and_every_rule_loads(observed_run):
    assert observed_run["fired"], f"{EXPIRY_ALERT} never fired; alerts: {observed_run['alerts']}"
    for group in observed_run["rules"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", f"rule {rule['name']}: {rule.get('lastError')}"
    # D was killed, not healthy: the healthy-D alert may go pending (extensions in its 2 m window
    # predate the kill) but must not fire (for: 5m, longer than that window)
    assert not any(a["labels"]["alertname"] == "LeaseExpiriesWhileDecodeHealthy" and a["state"] == "firing"
                   for a in observed_run["alerts"])


def test_every_dashboard_panel_query_returns_data(observed_run):
    """This pair runs pull mode: every panel reading a series a pull-mode server exports shows data (the push-only
    panels are checked on a push pair in test_push_mode.py)."""
    pull = [(title, expr, result) for title, expr, result in observed_run["panels"] if "pull" in expression_modes(expr)]
    empty = [f"{title}: {expr}" for title, expr, result in pull if not result]
    assert not empty, "panel queries without data:\n" + "\n".join(empty)
    push_only = [expr for _, expr, _ in observed_run["panels"] if "pull" not in expression_modes(expr)]
    assert len(pull) >= 20 and all(expression_modes(expr) == {"push"} for expr in push_only), push_only


def test_explain_prints_the_lease_timeline_and_spans_join_one_trace(observed_run):
    pair, load = observed_run["pair"], observed_run["load"]
    request_id = load.request_ids[0]
    done = leasekit("explain", request_id, "--run-dir", str(pair.run_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "grant" in done.stdout and "expire" in done.stdout and request_id in done.stdout
    doc = json.loads(leasekit("explain", request_id, "--run-dir", str(pair.run_dir), "-o", "json").stdout)
    assert json.dumps(doc).count("heartbeat_lapsed") or "expired" in json.dumps(doc)
    # the normally served request: P's lease span, D's heartbeat span and D's read span, joined by
    # request id and trace
    served_id = observed_run["served"].prefill.request_id
    spans = [s for s in read_span_dir(pair.span_dir).spans if s.attributes.get(sc.REQUEST_ID) == served_id]
    names = sorted(s.name for s in spans)
    assert names == sorted([sc.LEASE_SPAN_NAME, sc.HEARTBEATS_SPAN_NAME, sc.READ_SPAN_NAME]), names
    trace_id = observed_run["served"].prefill.traceparent.split("-")[1]
    assert {s.trace_id for s in spans} == {trace_id}, "P's and D's lease spans must join the router's trace"
    # vLLM's own request spans (P's and D's llm_request), exported over OTLP, are in the same trace
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len([t for _n, t, _a in observed_run["otlp"].spans() if t == trace_id]) < 2:
        time.sleep(0.5)
    vllm_spans = [(name, attrs) for name, t, attrs in observed_run["otlp"].spans() if t == trace_id]
    assert len(vllm_spans) >= 2, f"vLLM request spans in trace {trace_id}: {vllm_spans}"
