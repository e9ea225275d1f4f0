"""D's side of the lease proofs (leasekit/lease/proof.py, docs/security.md): which heartbeat ids carry a
heartbeat tag, how a large heartbeat is split into complete ones, the completion tag in ``_read_blocks``, the
version-4 hello, and the state D keeps for them (leasekit/vllm/decode/gate.py, heartbeats.py, hooks.py,
leasekit/vllm/taps.py). Each tag is checked with P's own verifier (:class:`leasekit.lease.proof.LeaseProofs`)
under the engine key that minted the secret, and each notification with P's decoder."""

import logging
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import leasekit.vllm.decode.gate as gate_module
from leasekit.lease.codec import (
    Completion,
    Heartbeat,
    decode_notification,
    encode_completion,
    split_protocol_ids,
)
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import LeaseProofs, lease_secret, secret_text, split_tagged
from leasekit.lease.readgate import FAIL, OUTCOME_VERIFIED, GateResult
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_log import lease_logger
from leasekit.vllm.decode.gate import DReadGate
from leasekit.vllm.decode.heartbeats import DHeartbeatSender, DLeaseSecrets
from leasekit.vllm.decode.hooks import DHooks
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.taps import MAX_HEARTBEAT_CHUNK_BYTES, NotificationTap, WireHeartbeat, split_heartbeat
from leasekit.vllm.verdictchan import decode_hello_payload

KEY = bytes(range(32))
"""P engine ``P-engine``'s key (its secrets are ``lease_secret(KEY, P request id)``)."""
P = LeaseProofs(KEY)
AGENT = "p0-agent-name"


def secret_of(rid, key=KEY):
    return secret_text(lease_secret(key, rid))


def entry(d_id, p_id, engine="P-engine", secret=True, marker=4, key=KEY):
    """One ``leasekit_protected`` entry of the scheduler's contract (7 fields)."""
    return [d_id, engine, "127.0.0.1", None, p_id, secret_of(p_id, key) if secret else None, marker]


class RawWire:
    """NIXL's ``send_notif``, recording ``(agent, bytes)``; ``fail_at``: the 1-based send that raises."""

    def __init__(self, fail_at=None):
        self.sent = []
        self.fail_at = fail_at

    def send_notif(self, agent, notif_msg):
        if self.fail_at is not None and len(self.sent) + 1 == self.fail_at:
            self.fail_at = None
            raise RuntimeError("NIXL send failed")
        self.sent.append((agent, bytes(notif_msg)))


class StockD:
    """vLLM's D worker as the gate sees it; ``_read_blocks`` records the keyword arguments it got."""

    def __init__(self):
        self.tp_rank = 0
        self._remote_agents = {"P-engine": {(0, 0): AGENT}, "P-old": {(0, 0): "q0"}}
        self._recving_transfers: dict = {}
        self._recving_metadata: dict = {}
        self._recv_failures: set[str] = set()
        self.raw = RawWire()
        self.reads: list[dict] = []

    def _read_blocks(self, **kwargs):
        self.reads.append(kwargs)
        return True


class HookedD(DHooks, StockD):
    _lk_ready = True


class Raise:
    def report(self, where, exc):
        raise exc


_GATES: list[DReadGate] = []


@pytest.fixture(autouse=True)
def _close_gates():
    """Close every gate a test built, even when it failed (an open ZMQ socket would block the exit)."""
    yield
    while _GATES:
        _GATES.pop().close()


def make_d(errors=None):
    """A hooked D worker whose NIXL wrapper is LeaseKit's tap (rewrite: the gate's), as the connector builds it."""
    worker = HookedD()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reported = []
    worker.nixl_wrapper = NotificationTap(worker.raw, lambda agent, msg, ok: reported.append((agent, bytes(msg), ok)))
    gate = worker._lk_gate = DReadGate(
        VllmDState(worker), timeout_s=6.0, lease_duration_s=6.0, tracer=provider.get_tracer("t"),
        stats=LeaseStatsObserver(LeaseKitKVConnectorStats(), 0), errors=errors or Raise(),
        faults=SimpleNamespace(enabled=False), drop=lambda *a: None, context_of=lambda rid: None,
    )
    worker.nixl_wrapper.rewrite = gate.sequence_heartbeat
    _GATES.append(gate)
    return SimpleNamespace(worker=worker, gate=gate, wire=worker.raw, reported=reported, exporter=exporter)


def read(d, request_id="d1", remote="P1", engine="P-engine", consumers=1):
    return d.worker._read_blocks(request_id=request_id, remote_request_id=remote, dst_engine_id=engine,
                                 read_spec=SimpleNamespace(remote_rank=0), expected_consumers=consumers)


def wire_ids(msg, limit=MAX_HEARTBEAT_CHUNK_BYTES):
    """``(seq, [(P request id, tag or None)])`` of a heartbeat notification, decoded as P decodes it."""
    heartbeat = decode_notification(msg, max_bytes=limit)
    assert isinstance(heartbeat, Heartbeat), heartbeat
    seq, hello, rest = split_protocol_ids(heartbeat.req_ids)
    assert hello is None
    return seq, [split_tagged(i) or (i, None) for i in rest]


def hellos(d):
    """Every hello D sent, decoded: ``[(agent, Hello)]``."""
    out = []
    for agent, msg in d.wire.sent:
        if msg.startswith(b"HB:LK1~H~"):
            _seq, payload, _ = split_protocol_ids(decode_notification(msg).req_ids)
            out.append((agent, decode_hello_payload(payload)))
    return out


# -- heartbeat tags -----------------------------------------------------------------------------------


def test_only_ids_whose_grant_carried_a_secret_are_tagged_and_p_verifies_the_tag():
    d = make_d()
    d.gate.protect([
        entry("d1", "P1"),
        ["d2", "P-engine", "127.0.0.1", None],  # an older scheduler: 4 fields, no secret
        entry("d3", "P3", marker=3),  # a version-3 P: it would not know a tagged id, whatever the grant says
        entry("d4", "P4", secret=False),  # a version-4 P that minted no secret
        ["d5", "P-engine", "127.0.0.1", None, "P5", "NOT-HEX" * 4 + "abcd", 4],  # a garbled token
    ])
    assert d.worker.nixl_wrapper.send_notif(AGENT, b"HB:P1,P2,P3,P4,P5,P6") is None
    ((agent, msg),) = d.wire.sent
    seq, ids = wire_ids(msg)
    assert agent == AGENT and seq is None  # no hello heard yet: no sequence token
    assert [rid for rid, _tag in ids] == ["P1", "P2", "P3", "P4", "P5", "P6"]
    assert ids[0][1] == P.heartbeat_tag("P1") and all(tag is None for _rid, tag in ids[1:])
    assert msg == b"HB:P1~" + P.heartbeat_tag("P1").encode() + b",P2,P3,P4,P5,P6"
    assert d.reported == [(AGENT, b"HB:P1,P2,P3,P4,P5,P6", True)]  # the callback sees vLLM's ids
    assert LeaseProofs(bytes(32)).heartbeat_tag("P1") != ids[0][1]  # another engine's key: no match


def test_a_heartbeat_without_secrets_goes_out_byte_for_byte_and_gets_only_the_sequence_token():
    d = make_d()
    msg = b"HB:P1,P2"
    assert d.gate.sequence_heartbeat(AGENT, msg, 1.0) is msg
    d.gate.hello_sent.add(AGENT)
    wire = d.gate.sequence_heartbeat(AGENT, msg, 1.0)
    seq, ids = wire_ids(wire)
    assert ids == [("P1", None), ("P2", None)] and seq in d.gate.gate._sent[AGENT]


def test_the_read_probe_names_the_lease_with_its_tag():
    d = make_d()
    d.gate.protect([entry("d1", "P1")])
    assert read(d)
    probes = [msg for _agent, msg in d.wire.sent if not msg.startswith(b"HB:LK1~H~")]
    ((msg),) = probes
    seq, ids = wire_ids(msg)
    assert ids == [("P1", P.heartbeat_tag("P1"))] and seq in d.gate.gate._sent[AGENT]  # the hello preceded it


# -- splitting ------------------------------------------------------------------------------------------


def check_parts(d, sent, ids, limit, secret_ids):
    """Every part within ``limit``, a well-formed heartbeat with its own sequence token, and together
    every id exactly once, in order, tagged exactly when it has a secret (P's verifier agrees)."""
    seqs, seen = [], []
    for agent, msg in sent:
        assert agent == AGENT and len(msg) <= limit
        seq, part = wire_ids(msg, limit)
        seqs.append(seq)
        for rid, tag in part:
            assert (tag is not None) == (rid in secret_ids)
            assert tag is None or tag == P.heartbeat_tag(rid)
            seen.append(rid)
    assert seen == ids
    assert None not in seqs and len(set(seqs)) == len(seqs) and set(seqs) <= set(d.gate.gate._sent[AGENT])
    return seqs


def test_a_heartbeat_over_the_chunk_size_is_split_into_complete_sequenced_heartbeats():
    d = make_d()
    ids = [f"cmpl-{i:06d}-" + "x" * 90 for i in range(3000)]  # ~300 KB: over 256 KiB
    secret_ids = set(ids[::2])
    d.gate.protect([entry(f"d{i}", rid) for i, rid in enumerate(ids) if rid in secret_ids])
    d.gate.hello_sent.add(AGENT)
    d.worker.nixl_wrapper.send_notif(AGENT, ("HB:" + ",".join(ids)).encode())
    assert len(d.wire.sent) == 2
    check_parts(d, d.wire.sent, ids, MAX_HEARTBEAT_CHUNK_BYTES, secret_ids)
    # on_heartbeat_sent: once per notification, with that notification's ids as vLLM named them
    assert [ok for _a, _m, ok in d.reported] == [True, True]
    assert b",".join(m[3:] for _a, m, _ok in d.reported) == ",".join(ids).encode()


def test_splitting_under_a_small_limit_keeps_every_id_once_and_each_part_within_it(monkeypatch):
    monkeypatch.setattr(gate_module, "MAX_HEARTBEAT_CHUNK_BYTES", 200)
    d = make_d()
    ids = [f"r{i}" * (1 + i % 5) for i in range(60)]
    secret_ids = {rid for rid in ids if rid.endswith(("1", "4"))}
    d.gate.protect([entry(f"d{i}", rid) for i, rid in enumerate(ids) if rid in secret_ids])
    d.gate.hello_sent.add(AGENT)
    d.worker.nixl_wrapper.send_notif(AGENT, ("HB:" + ",".join(ids)).encode())
    assert len(d.wire.sent) > 5
    check_parts(d, d.wire.sent, ids, 200, secret_ids)
    assert [m for _a, m, _ok in d.reported] == [
        b"HB:" + b",".join(rid.encode() for rid, _tag in wire_ids(m, 200)[1]) for _a, m in d.wire.sent]


def test_an_id_longer_than_the_chunk_goes_alone_and_the_others_around_it_still_fit():
    ids = ["a" * 10, "b" * 10, "L" * 100, "c" * 10]
    parts = split_heartbeat(ids, ids, limit=30)
    assert [p.original for p in parts] == [b"HB:" + b"a" * 10 + b"," + b"b" * 10, b"HB:" + b"L" * 100,
                                           b"HB:" + b"c" * 10]
    assert split_heartbeat([], [], 30) == [WireHeartbeat(b"HB:", b"HB:")]
    with pytest.raises(ValueError):
        split_heartbeat(["a"], [], 30)


_IDS = st.lists(st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters=","), min_size=1,
                        max_size=40), max_size=40)


@given(_IDS, st.integers(min_value=8, max_value=200), st.data())
def test_split_heartbeat_keeps_order_and_bounds_for_any_ids(ids, limit, data):
    wire = [rid + "~" + "0" * 16 if data.draw(st.booleans()) else rid for rid in ids]
    parts = split_heartbeat(ids, wire, limit)
    got, got_wire = [], []
    for part in parts:
        part_ids = part.original[3:].decode().split(",") if ids else []
        assert len(part.wire) <= limit or len(part_ids) == 1  # over only when one id alone is over
        got += part_ids
        got_wire += part.wire[3:].decode().split(",") if ids else []
    assert got == ids and got_wire == wire


def test_a_failed_part_is_reported_with_its_ids_and_stops_the_rest(monkeypatch):
    monkeypatch.setattr(gate_module, "MAX_HEARTBEAT_CHUNK_BYTES", 40)
    d = make_d()
    d.wire.fail_at = 2
    ids = [f"id-{i:02d}-xxxxxx" for i in range(6)]  # 15 bytes each: two per part, three parts
    with pytest.raises(RuntimeError):
        d.worker.nixl_wrapper.send_notif(AGENT, ("HB:" + ",".join(ids)).encode())
    assert [m for _a, m in d.wire.sent] == [("HB:" + ",".join(ids[:2])).encode()]
    assert d.reported == [(AGENT, ("HB:" + ",".join(ids[:2])).encode(), True),
                          (AGENT, ("HB:" + ",".join(ids[2:4])).encode(), False)]


def test_the_heartbeat_send_failure_warning_names_the_agent_by_reference_only():
    worker = StockD()
    stats = LeaseKitKVConnectorStats()
    warned = []
    beats = DHeartbeatSender(VllmDState(worker), spans=SimpleNamespace(sent=lambda ids: None),
                             stats=LeaseStatsObserver(stats, 0), errors=Raise(),
                             faults=SimpleNamespace(enabled=False), extension_s=2.5,
                             warning=SimpleNamespace(warn=lambda msg, *args, **f: warned.append((msg % args, f))))
    beats.sent(AGENT, b"HB:P1", True)
    beats.sent(AGENT, b"HB:P2", False)
    ((message, fields),) = warned
    assert AGENT not in message and peer_ref(AGENT) in message and fields["remote_engine_id"] == "P-engine"


# -- completions ----------------------------------------------------------------------------------------


def test_a_proved_requests_completion_carries_its_completion_tag_for_its_consumer_count():
    d = make_d()
    d.gate.protect([entry("d1", "P1"), ["d2", "P-engine", "127.0.0.1", None]])
    read(d, consumers=2)
    read(d, request_id="d2", remote="P2")
    proved, plain = d.worker.reads
    assert plain["remote_request_id"] == "P2"
    rid, tag = split_tagged(proved["remote_request_id"])
    assert rid == "P1" and P.completion_ok("P1", 2, tag) and not P.completion_ok("P1", 1, tag)
    # vLLM builds f"{remote_request_id}:{expected_consumers}"; P decodes it as the tagged completion
    completion = decode_notification(encode_completion(proved["remote_request_id"], proved["expected_consumers"]))
    assert completion == Completion(f"P1~{tag}", 2)
    assert {k: v for k, v in proved.items() if k != "remote_request_id"} == {
        k: v for k, v in d.worker.reads[0].items() if k != "remote_request_id"}
    assert d.gate.gate._owner[(AGENT, "P1")] == "d1"  # the gate waits for P's verdict on the plain id


def test_a_completion_tag_that_cannot_be_made_fails_the_read_closed():
    d = make_d(errors=SimpleNamespace(report=lambda where, exc: None))
    d.gate.protect([entry("d1", "P1")])
    kwargs = {"request_id": "d1", "remote_request_id": "P1"}  # no expected_consumers: no tag
    assert d.gate.proved_read(kwargs) is kwargs and d.gate.gate.hold("d1") == FAIL  # decided ungated


# -- hello ----------------------------------------------------------------------------------------------


def test_the_hello_to_a_version_4_engine_proves_the_lease_and_an_older_engine_gets_the_old_hello():
    d = make_d()
    d.gate.protect([entry("d1", "P1"), ["d2", "P-old", "127.0.0.1", None, "Q2", None, 3]])
    read(d)
    read(d, request_id="d2", remote="Q2", engine="P-old")
    (agent1, new), (agent2, old) = hellos(d)
    assert agent1 == AGENT and new.req_id == "P1" and new.endpoint in d.gate.inbox.endpoints
    assert P.hello_ok("P1", new.endpoint, new.token, new.tag) and new.token == d.gate.inbox.token
    assert not P.hello_ok("P1", new.endpoint, "f" * 16, new.tag)  # bound to the inbox's token
    assert agent2 == "q0" and (old.req_id, old.tag) == (None, None) and old.endpoint == new.endpoint


def test_the_heartbeat_path_hello_proves_the_engines_latest_lease_even_after_it_finished():
    d = make_d()
    d.gate.protect([entry("d1", "P1"), entry("d2", "P2")])
    d.gate.finish(["d2"])
    d.gate.hello_engines({"P-engine": SimpleNamespace(req_ids={"P1"})})
    ((agent, hello),) = hellos(d)
    assert hello.req_id == "P2" and P.hello_ok("P2", hello.endpoint, hello.token, hello.tag)
    d.gate.hello_engines({"P-engine": SimpleNamespace(req_ids={"P1"})})
    assert len(hellos(d)) == 1  # once per agent


def test_the_hello_log_names_the_p_agent_by_reference_and_read_spans_too():
    d = make_d()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = lease_logger()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        d.gate.protect([entry("d1", "P1")])
        read(d)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        (line,) = [r for r in records if "said hello" in r]
    assert AGENT not in line and peer_ref(AGENT) in line and "lease proof" in line
    d.gate._record_read(GateResult("d1", "P1", OUTCOME_VERIFIED, 0.01, (AGENT,)), now=1.0)
    (span,) = d.exporter.get_finished_spans()
    assert list(span.attributes[sc.READ_AGENTS]) == [peer_ref(AGENT)]


# -- state ----------------------------------------------------------------------------------------------


def test_finish_forgets_the_requests_secret_and_its_ids_go_plain():
    d = make_d()
    d.gate.protect([entry("d1", "P1"), entry("d2", "P2")])
    assert len(d.gate.secrets) == 2
    d.gate.finish(["d1"])
    assert d.gate.secrets.secret("P1") is None and d.gate.secrets.secret("P2") is not None
    assert len(d.gate.secrets) == 1 and d.gate.secrets._remote_of == {"d2": "P2"}
    assert d.gate.sequence_heartbeat(AGENT, b"HB:P1", 0.0) == b"HB:P1"
    kwargs = {"request_id": "d1", "remote_request_id": "P1", "expected_consumers": 1}
    assert d.gate.proved_read(kwargs) is kwargs
    d.gate.finish(["d2", "never-protected"])
    assert len(d.gate.secrets) == 0 and d.gate.secrets._remote_of == {}


def test_a_p_request_taken_over_by_another_d_request_survives_the_first_ones_finish():
    s = DLeaseSecrets()
    s.add("d1", "E", "P1", lease_secret(KEY, "P1"))
    s.add("d2", "E", "P1", lease_secret(KEY, "P1"))
    s.finish("d1")
    assert s.secret("P1") == lease_secret(KEY, "P1")
    s.finish("d2")
    assert s.secret("P1") is None and len(s) == 0


def test_the_secrets_d_keeps_are_bounded_per_request_and_per_engine():
    s = DLeaseSecrets(max_requests=3, max_engines=2)
    for i in range(6):
        s.add(f"d{i}", f"E{i % 3}", f"P{i}", lease_secret(KEY, f"P{i}"))
    assert len(s) == 3 and [s.secret(f"P{i}") is not None for i in range(6)] == [False] * 3 + [True] * 3
    assert sorted(s._remote_of) == ["d3", "d4", "d5"]
    assert s.hello_proof("E0") is None and s.hello_proof("E2")[0] == "P5"
    assert s.hello_proof("E2", prefer="P4")[0] == "P4"  # the lease being read, when it has a secret
    assert s.hello_proof("E2", prefer="P0")[0] == "P5"  # forgotten: the engine's latest


def test_an_id_too_long_to_carry_a_tag_or_unfit_for_a_hello_is_handled_without_breaking_others():
    s = DLeaseSecrets()
    s.add("d1", "E", "x" * 1020, lease_secret(KEY, "x"))  # 1020 + 17 > 1024: P would refuse the heartbeat
    assert len(s) == 0
    s.add("d2", "E", "has space", lease_secret(KEY, "has space"))
    s.add("d3", "E", "ctl\x01", lease_secret(KEY, "ctl\x01"))
    assert s.secret("has space") is not None and s.secret("ctl\x01") is not None and s.hello_proof("E") is None
