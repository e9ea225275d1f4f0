"""Nothing a peer claims, and nothing unbounded, on /metrics; spans and logs name a D worker by its peer
reference. Real parts end to end: LeaseSpanRecorder -> LeaseStatsObserver -> KVConnectorStats -> msgpack
(as vLLM ships it) -> LeaseKitPromMetrics -> a prometheus-client registry, scraped as text; spans through
the OpenTelemetry SDK; log records through the logging module."""

import functools
import logging
from types import SimpleNamespace

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from leasekit.lease import LeaseTiming
from leasekit.lease.peerref import peer_ref
from leasekit.telemetry import metrics as m
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_log import LeaseLogObserver, RateLimitedWarning
from leasekit.telemetry.lease_spans import LeaseSpanRecorder
from leasekit.telemetry.peers import MAX_PEERS, RETURN_WINDOW_S, PeerTable

stats_mod = pytest.importorskip("leasekit.vllm.stats")  # needs vLLM (installed by setup.sh)

TIMING = LeaseTiming.from_lease_duration(6)  # H=1, E=4: "silent" after 2 s without a heartbeat
AGENTS = ("nixl-agent-3f9c0d2e-decode-worker-0", "nixl-agent-81aa7b44-decode-worker-1",
          "nixl-agent-restarted-5c1e")
REQUEST_IDS = [f"cmpl-secret-request-{i:04d}-0" for i in range(6)]


class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _logger(name):
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    keep = Keep()
    logger.addHandler(keep)
    return logger, keep


class Pworker:
    """One P worker as the connector builds it: recorder with the stats observer and the lease log."""

    def __init__(self, rank, logger):
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.stats = stats_mod.LeaseKitKVConnectorStats()
        self.observer = stats_mod.LeaseStatsObserver(self.stats, rank)
        self.rec = LeaseSpanRecorder(provider.get_tracer("t"), engine_id="P0", tp_rank=rank, timing=TIMING,
                                     observers=(self.observer, LeaseLogObserver(logger)))
        self.observer.config("kv_producer", TIMING)


def _prom(registry):
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return stats_mod.LeaseKitPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                         {0: ["tiny", "0"]})


def _ship(prom, *workers):
    total = workers[0].stats.clone_and_reset()
    for w in workers[1:]:
        total = total.aggregate(w.stats.clone_and_reset())
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict()))
    prom.observe(stats_mod.LeaseKitKVConnectorStats(data=wire).data, 0)


def _scenario(w0, w1):
    """Every P-side path a peer's name or a request id passes: extensions, a read, releases, expiries
    (heartbeating, silent, unknown), late reads (fail-closed or not), a silent D's return, a restarted D."""
    a, b, restarted = AGENTS
    r = REQUEST_IDS
    for w in (w0, w1):
        for req in r[:5]:
            w.rec.grant(req, 106.0, kv_blocks=2, now=100.0)
    w0.rec.extend(r[0], 105.0, remote_agent=a, now=101.0)  # r0: a's, then lapses while a heartbeats r1
    w0.rec.extend(r[1], 105.0, remote_agent=a, now=101.0)
    w0.rec.extend(r[2], 105.0, remote_agent=b, now=101.0)  # b goes silent after 101
    w0.rec.extend(r[1], 110.0, remote_agent=a, now=104.5)
    w0.rec.retrieval(r[1], remote_agent=a, now=104.8)
    w0.rec.release(r[1], now=104.8)
    w0.rec.expire(r[0], now=105.1)  # a heartbeated 0.6 s before: heartbeating
    w0.rec.expire(r[2], now=105.1)  # b last heard 4.1 s before: silent
    w0.rec.expire(r[3], now=106.1)  # never heard of a D: unknown
    w1.rec.expire(r[0], now=106.1)
    w0.rec.late_read(r[2], remote_agent=b, now=106.5, fail_closed=False)
    w0.rec.late_read(r[0], remote_agent=a, now=106.5, fail_closed=True)
    w0.rec.grant(r[5], 116.0, now=110.0)
    w0.rec.extend(r[5], 116.0, remote_agent=b, now=111.0)  # b is back: its silent expiry was a stall
    w0.rec.extend(r[4], 116.0, remote_agent=restarted, now=111.0)  # a new agent: no return
    for w in (w0, w1):
        w.observer.state(w.rec.expiring_within(1.0, now=111.0))


def test_the_scraped_exposition_holds_no_agent_name_and_no_request_id():
    registry = CollectorRegistry()
    prom = _prom(registry)
    logger, _ = _logger("test.peer.scrape")
    w0, w1 = Pworker(0, logger), Pworker(1, logger)
    _ship(prom, w0, w1)  # the zero series
    _scenario(w0, w1)
    _ship(prom, w0, w1)
    text = generate_latest(registry).decode()
    # the scenario reached the registry...
    assert registry.get_sample_value("leasekit_kv_lease_extensions_total",
                                     {"model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": "0"}) == 6
    assert "leasekit_kv_lease_late_completions_total" in text and "leasekit_kv_lease_expiries_total" in text
    # ...and no string a peer chose, or a request id, or a reference to one, is in the exposition
    for secret in (*AGENTS, *map(peer_ref, AGENTS), *REQUEST_IDS, "cmpl-secret", "nixl-agent", "peer-"):
        assert secret not in text, secret
    assert "remote_agent" not in text
    # every P-side label value is from a closed set: the series set does not grow with peers or requests
    closed = {"model_name": {"tiny"}, "engine": {"0"}, "mode": {"pull"}, "tp_rank": {"0", "1"}, "kv_role": {"kv_producer"},
              "cause": set(m.EXPIRY_CAUSES), "peer_state": set(m.PEER_STATES), "fail_closed": {"true", "false"},
              "outcome": set(m.HOLD_OUTCOMES) | set(m.READ_OUTCOMES) | set(m.PUSH_WRITE_OUTCOMES), "proof": set(m.READ_PROOFS) | set(m.PROOF_KINDS),
              "reason": set(m.NOTIFICATION_DROP_REASONS) | set(m.SPAN_DROP_REASONS), "remote_engine_id": {"unknown"}}
    for family in registry.collect():
        for sample in family.samples:
            for label, v in sample.labels.items():
                if label != "le":
                    assert v in closed[label], (sample.name, label, v)


def test_expiries_say_what_p_knew_of_the_d_and_a_silent_d_that_came_back_is_counted():
    registry = CollectorRegistry()
    prom = _prom(registry)
    logger, _ = _logger("test.peer.states")
    w0, w1 = Pworker(0, logger), Pworker(1, logger)
    _scenario(w0, w1)
    _ship(prom, w0, w1)

    def expiries(rank, cause, state):
        return registry.get_sample_value("leasekit_kv_lease_expiries_total", {
            "model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": rank, "cause": cause, "peer_state": state})

    assert expiries("0", "heartbeat_lapsed", "heartbeating") == 1
    assert expiries("0", "heartbeat_lapsed", "silent") == 1
    assert expiries("0", "no_heartbeat", "unknown") == 1
    assert expiries("1", "no_heartbeat", "unknown") == 1
    assert expiries("0", "heartbeat_lapsed", "unknown") == 0
    # b's one silent expiry, b heard from again 5.9 s later: 1; the restarted agent returns nothing
    assert registry.get_sample_value("leasekit_kv_lease_expired_peer_returns_total",
                                     {"model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": "0"}) == 1
    assert registry.get_sample_value("leasekit_kv_lease_expired_peer_returns_total",
                                     {"model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": "1"}) == 0
    # the spans carry the same state
    states = {s.attributes[sc.REQUEST_ID]: s.attributes.get(sc.EXPIRY_PEER_STATE)
              for s in w0.exporter.get_finished_spans() if s.name == sc.LEASE_SPAN_NAME}
    assert states == {REQUEST_IDS[0]: "heartbeating", REQUEST_IDS[1]: None, REQUEST_IDS[2]: "silent",
                      REQUEST_IDS[3]: "unknown"}


def test_a_return_counts_once_and_only_within_the_window():
    registry = CollectorRegistry()
    prom = _prom(registry)
    logger, _ = _logger("test.peer.window")
    w = Pworker(0, logger)
    agent = AGENTS[0]
    for req, t in (("R1", 100.0), ("R2", 100.0)):
        w.rec.grant(req, t + 6, now=t)
        w.rec.extend(req, t + 5, remote_agent=agent, now=t + 1)
    w.rec.expire("R1", now=106.0)
    w.rec.expire("R2", now=106.0)
    w.rec.grant("R3", 120.0, now=114.0)
    w.rec.extend("R3", 119.0, remote_agent=agent, now=115.0)  # back: 2 returns
    w.rec.grant("R4", 120.0, now=114.0)
    w.rec.extend("R4", 119.0, remote_agent=agent, now=115.0)  # already counted: nothing more
    w.rec.expire("R3", now=119.5)
    w.rec.expire("R4", now=119.5)
    late = 119.5 + RETURN_WINDOW_S + 1
    w.rec.grant("R5", late + 6, now=late)
    w.rec.extend("R5", late + 5, remote_agent=agent, now=late + 1)  # back, but after the window: not counted
    _ship(prom, w)
    assert registry.get_sample_value("leasekit_kv_lease_expired_peer_returns_total",
                                     {"model_name": "tiny", "engine": "0", "mode": "pull", "tp_rank": "0"}) == 2


def test_spans_and_logs_name_the_peer_by_its_reference_never_its_agent_name():
    logger, keep = _logger("test.peer.logs")
    w0, w1 = Pworker(0, logger), Pworker(1, logger)
    _scenario(w0, w1)
    refs = set(map(peer_ref, AGENTS))
    spans = w0.exporter.get_finished_spans() + w1.exporter.get_finished_spans()
    dumped = repr([(dict(s.attributes), [dict(e.attributes) for e in s.events]) for s in spans])
    for agent in AGENTS:
        assert agent not in dumped
    seen = {s.attributes.get(sc.REMOTE_AGENT) for s in spans} - {None}
    assert seen == {peer_ref(AGENTS[0]), peer_ref(AGENTS[1])}  # lease and late-read spans
    reads = [e for s in spans for e in s.events if e.name == sc.EVENT_RETRIEVAL]
    assert [e.attributes[sc.EV_REMOTE_AGENT] for e in reads] == [peer_ref(AGENTS[0])]
    # every lease log record: fields and message
    assert {r.event for r in keep.records} >= {"grant", "extend", "expire", "late_read", "peer_returned"}
    for record in keep.records:
        text = record.getMessage() + repr(vars(record))
        for agent in AGENTS:
            assert agent not in text
        if getattr(record, "remote_agent", None) is not None:
            assert record.remote_agent in refs
    (returned,) = [r for r in keep.records if r.event == "peer_returned"]
    assert returned.levelno == logging.WARNING and returned.count == 1
    assert f"peer={peer_ref(AGENTS[1])}" in returned.getMessage()
    (silent,) = [r for r in keep.records if r.event == "expire" and r.peer_state == "silent"]
    assert f"peer={peer_ref(AGENTS[1])}" in silent.getMessage() and "peer_state=silent" in silent.getMessage()


def test_rate_limited_warnings_log_the_reference_in_the_field_and_the_message():
    logger, keep = _logger("test.peer.warn")
    clock = iter([0.0, 20.0, 40.0, 60.0]).__next__
    warning = RateLimitedWarning(logger, interval_s=10.0, clock=clock)
    agent = AGENTS[0]
    assert warning.warn("dropped a notification from agent %s (%s)", agent, "foreign_heartbeat",
                        event="notification_dropped", remote_agent=str(agent))
    assert warning.warn("D agent %s read late", agent.encode(), event="late_read", remote_agent=agent.encode())
    assert warning.warn("no agent here: %s", "x", event="other")
    assert warning.warn("verdict to %s failed (%s: %s)", agent, "KeyError", KeyError(agent), event="verdict_send_failure",
                        remote_agent=agent)
    first, second, third, fourth = keep.records
    assert first.getMessage().startswith(f"dropped a notification from agent {peer_ref(agent)} (foreign_heartbeat)")
    assert first.remote_agent == peer_ref(agent) and second.remote_agent == peer_ref(agent)
    assert agent not in second.getMessage() and peer_ref(agent) in second.getMessage()
    assert not hasattr(third, "remote_agent") and third.getMessage().startswith("no agent here: x")
    assert agent not in fourth.getMessage()  # not even inside an exception's text
    assert fourth.getMessage().startswith(f"verdict to {peer_ref(agent)} failed (KeyError: '{peer_ref(agent)}')")


def test_the_peer_table_stays_bounded_and_keeps_peers_in_use_or_owed_a_return():
    table = PeerTable(max_peers=4)
    in_use = table.get("a0", 0.0)
    owed = table.get("a1", 0.0)
    owed.lapse(5.0)
    for i in range(2, 4):
        table.get(f"a{i}", 0.0)
    assert len(table) == 4
    table.get("new", 10.0, in_use=[in_use, None])  # prunes a2, a3 first
    assert len(table) == 3 and table.get("a0", 10.0) is in_use and table.get("a1", 10.0) is owed
    assert table.get("a0", 10.0).ref == peer_ref("a0")
    many = PeerTable()
    for i in range(3 * MAX_PEERS):  # a peer flooding new names only refills it
        many.get(f"flood-{i}", float(i))
    assert len(many) <= MAX_PEERS
    with pytest.raises(ValueError, match="max_peers"):
        PeerTable(max_peers=0)
