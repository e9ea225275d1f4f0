"""D's proofs when it reads: the completion tag in ``_read_blocks`` and the version-4 hello, checked as P does."""

import logging
from types import SimpleNamespace

from leasekit.lease.codec import Completion, decode_notification, encode_completion, split_protocol_ids
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import split_tagged
from leasekit.lease.readgate import FAIL, OUTCOME_VERIFIED, GateResult
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_log import lease_logger
from leasekit.vllm.verdictchan import decode_hello_payload
from tests.unit.d_proofs_helpers import _close_gates  # noqa: F401 - autouse: closes the gates a test built
from tests.unit.d_proofs_helpers import AGENT, P, entry, make_d, read


def hellos(d):
    """Every hello D sent, decoded: ``[(agent, Hello)]``."""
    out = []
    for agent, msg in d.wire.sent:
        if msg.startswith(b"HB:LK1~H~"):
            _seq, payload, _ = split_protocol_ids(decode_notification(msg).req_ids)
            out.append((agent, decode_hello_payload(payload)))
    return out


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
