"""A second NIXL peer against a real LeaseKitConnector P: the payloads that
crash stock P, forged heartbeats and completions, the max-hold cap, and a notification fuzz over NIXL.
P must keep serving throughout. The pair (L = 6 s, max hold 12 s) is the one shared with
tests/integration/test_handshake_listener.py (:mod:`tests.shared_pair`), which may have run first (it
restarts D and sends P bad side-channel requests, no notifications): drop counts are compared as deltas.

The fuzz sends ``LEASEKIT_FUZZ_NOTIFICATIONS`` generated notifications (default 20000 in CI; the long
budget is one command, see README "Fuzzing P's notification handling")."""

import os
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasekit.chaos.peer import NixlPeer
from leasekit.chaos.workload import QueuedDecodeLoad
from leasekit.lease.codec import DECODE_ERROR_REASONS, DecodeError, decode_notification
from leasekit.lease.heartbeat_ids import decode_heartbeat_ids
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import TOKEN_PARAM, heartbeat_tag, parse_secret
from leasekit.telemetry import metrics as m
from leasekit.telemetry.lease_timeline import read_leases
from tests.scrape import labelled
from tests.shared_pair import L, MAX_HOLD

pytestmark = pytest.mark.pair
E = L * 2 // 3  # heartbeat extension, seconds (vLLM's nixl/base_worker.py: E = L * 2 // 3): 4 s
DROPPED = m.NOTIFICATIONS_DROPPED.sample_names[0]
FUZZ_TOTAL = int(os.environ.get("LEASEKIT_FUZZ_NOTIFICATIONS", "20000"))
FUZZ_BATCH = 250


@pytest.fixture(scope="module")
def pair(shared_pair):
    """The shared LeaseKit pair: ``L`` = 6 s, P's max hold ``MAX_HOLD`` = 12 s."""
    return shared_pair


@pytest.fixture(scope="module")
def peer(pair):
    with NixlPeer() as p:
        p.p_agent = p.handshake("127.0.0.1", pair.prefill.side_channel_port)
        yield p


def drops(pair) -> Counter:
    return labelled(pair.prefill.url, DROPPED, "reason")


def wait_drops(pair, expected: Counter, timeout_s: float = 30.0) -> Counter:
    """Poll P's /metrics until every expected reason reached its count (P ships stats per step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = drops(pair)
        if all(got[r] >= n for r, n in expected.items()) or time.monotonic() > deadline:
            return got
        pair.router.generate(pair.prompt(8), 1)  # make P step
        time.sleep(0.3)


def lease(pair, request_id: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for timeline in read_leases(pair.span_dir)[0]:
            if timeline.request_id == request_id:
                return timeline
        time.sleep(0.2)
    raise AssertionError(f"lease {request_id} never ended within {timeout_s} s")


def serves(pair) -> None:
    result = pair.router.generate(pair.prompt(32), 4)
    assert result.decode is not None and result.decode.ok, (result.prefill, result.decode)
    assert len(result.decode.token_ids) == 4


def test_payloads_that_crash_stock_p_are_counted_and_p_keeps_serving(pair, peer):
    before = drops(pair)
    live = pair.router.prefill(pair.prompt(32)).request_id
    for payload in (b"\xff\xfe\x00", b"abc", f"{live}:x".encode()):
        peer.send(peer.p_agent, payload)
    serves(pair)
    got = wait_drops(pair, before + Counter({"not_utf8": 1, "no_colon": 1, "bad_count": 1}))
    assert got - before == Counter({"not_utf8": 1, "no_colon": 1, "bad_count": 1})
    assert pair.prefill.alive()


def test_forged_completion_from_a_second_peer_does_not_free_a_live_lease(pair, peer):
    before = drops(pair)
    load = QueuedDecodeLoad(pair, requests=1)
    load.start()
    rid = load.request_ids[0]
    time.sleep(2.5)  # D heartbeats (H = 1 s): the lease is bound to D's agent
    peer.send(peer.p_agent, f"{rid}:1".encode())
    time.sleep(1.0)
    load.release_slot()
    assert load.wait_decodes(120)
    assert load.decodes[0].ok and len(load.decodes[0].token_ids) == load.decode_tokens
    timeline = lease(pair, rid)
    assert timeline.outcome == "released" and timeline.retrievals == 1
    assert timeline.remote_agent != peer_ref(peer.name), "the forger must not own the lease"
    assert timeline.end_s - timeline.grant_s > 3.0, "released by D's read, not by the forgery"
    assert drops(pair)["unproven_completion"] - before["unproven_completion"] >= 1  # D proved the lease first


def test_forged_heartbeats_from_a_second_peer_do_not_keep_a_lease_alive(pair, peer):
    before = drops(pair)
    prefill = pair.router.prefill(pair.prompt(32))  # nobody decodes it: only peers touch it
    rid, secret = prefill.request_id, parse_secret(prefill.kv_transfer_params.get(TOKEN_PARAM))
    with NixlPeer() as owner:  # holds the grant's secret, as the router's D would
        agent = owner.handshake("127.0.0.1", pair.prefill.side_channel_port)
        owner.send(agent, f"HB:{rid}~{heartbeat_tag(secret)}".encode())  # proves the lease
        time.sleep(1.0)  # (a new agent's first notification waits for its UCX connection; let it land)
        until = time.monotonic() + E + 4
        while time.monotonic() < until:
            peer.send(peer.p_agent, f"HB:{rid}".encode())
            time.sleep(0.5)
    serves(pair)
    timeline = lease(pair, rid)
    assert timeline.outcome == "expired"
    assert timeline.heartbeat_count == 1, "only the proven heartbeat extends"
    assert timeline.remote_agent == peer_ref(owner.name)
    assert drops(pair)["unproven_heartbeat"] - before["unproven_heartbeat"] >= 2


def test_max_hold_caps_a_lease_kept_alive_by_heartbeats(pair, peer):
    rid = pair.router.prefill(pair.prompt(32)).request_id
    with NixlPeer() as holder:
        agent = holder.handshake("127.0.0.1", pair.prefill.side_channel_port)
        until = time.monotonic() + MAX_HOLD + 4
        while time.monotonic() < until:
            holder.send(agent, f"HB:{rid}".encode())
            time.sleep(0.5)
    serves(pair)
    timeline = lease(pair, rid)
    assert timeline.outcome == "expired"
    hold = timeline.end_s - timeline.grant_s
    assert MAX_HOLD <= hold < MAX_HOLD + 2.0, f"held {hold:.2f} s; cap {MAX_HOLD} s"
    assert timeline.deadline_s == pytest.approx(timeline.grant_s + MAX_HOLD, abs=1e-3)


# -- fuzz --------------------------------------------------------------------------------------
_ids = st.text(st.characters(codec="utf-8"), min_size=0, max_size=12)
_notification = st.one_of(
    st.binary(max_size=48),
    st.builds(lambda ids: ("HB:" + ",".join(ids)).encode(), st.lists(_ids, max_size=4)),
    st.builds(lambda i, n: f"{i}:{n}".encode(), _ids, st.one_of(st.integers(-3, 5), _ids)),
    st.builds(lambda t: t.encode("utf-8", "surrogatepass"), st.text(max_size=24)),
    st.sampled_from([b"", b":", b"HB:", b"HB:,", b"\xff", b"a:0", b"a:-1", b"a: 1", b"a:\xd9\xa3", b"HB:\x00"]),
)
_sent: Counter = Counter()
_state: dict = {}


@settings(max_examples=max(1, FUZZ_TOTAL // FUZZ_BATCH), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(_notification, min_size=FUZZ_BATCH, max_size=FUZZ_BATCH))
def test_fuzz_notifications_over_nixl(pair, peer, batch):
    if "baseline" not in _state:
        _state["baseline"] = drops(pair)
    for message in batch:
        peer.send(peer.p_agent, message)
        _sent["total"] += 1
        if message.startswith(b"HB:"):  # P reads heartbeats id by id: junk ids are counted one by one
            parsed = decode_heartbeat_ids(message)
            if isinstance(parsed, DecodeError):
                _sent[parsed.reason] += 1
            elif parsed[1]:
                _sent["bad_heartbeat_id"] += parsed[1]
            continue
        decoded = decode_notification(message)
        if isinstance(decoded, DecodeError):
            _sent[decoded.reason] += 1


def test_after_the_fuzz_p_serves_and_counted_every_malformed_message(pair):
    assert _sent["total"] >= FUZZ_TOTAL, f"only {_sent['total']} notifications were sent"
    serves(pair)
    malformed = Counter({r: n for r, n in _sent.items() if r != "total"})
    baseline = _state["baseline"]
    got = wait_drops(pair, baseline + malformed, timeout_s=60)
    for reason in DECODE_ERROR_REASONS + ("bad_heartbeat_id",):  # P decodes with the same codecs: none lost
        assert got[reason] - baseline[reason] == malformed[reason], (
            f"{reason}: P counted {got[reason] - baseline[reason]}, the fuzzer sent {malformed[reason]}")
    assert pair.prefill.alive()
    log = pair.prefill.log_path.read_text()  # (vLLM logs a benign chat-template warm-up traceback)
    for crash in ("EngineDeadError", "UnicodeDecodeError", "invalid literal for int()", "not enough values to unpack"):
        assert crash not in log, crash
    serves(pair)
