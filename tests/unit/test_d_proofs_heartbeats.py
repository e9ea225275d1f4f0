"""D's heartbeat proofs: which ids carry a heartbeat tag (P's verifier agrees), and splitting into whole heartbeats."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import leasekit.vllm.decode.gate as gate_module
from leasekit.lease.codec import Heartbeat, decode_notification, split_protocol_ids
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import LeaseProofs, split_tagged
from leasekit.vllm.decode.heartbeats import DHeartbeatSender
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.taps import MAX_HEARTBEAT_CHUNK_BYTES, WireHeartbeat, split_heartbeat
from tests.unit.d_proofs_helpers import _close_gates  # noqa: F401 - autouse: closes the gates a test built
from tests.unit.d_proofs_helpers import AGENT, P, Raise, StockD, entry, make_d, read


def wire_ids(msg, limit=MAX_HEARTBEAT_CHUNK_BYTES):
    """``(seq, [(P request id, tag or None)])`` of a heartbeat notification, decoded as P decodes it."""
    heartbeat = decode_notification(msg, max_bytes=limit)
    assert isinstance(heartbeat, Heartbeat), heartbeat
    seq, hello, rest = split_protocol_ids(heartbeat.req_ids)
    assert hello is None
    return seq, [split_tagged(i) or (i, None) for i in rest]


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
