"""Lease ownership on a real LeaseKit P/D pair, with a second NIXL agent as the attacker
(:class:`leasekit.chaos.peer.NixlPeer`, which does vLLM's side-channel handshake as any peer that reaches
P's port can): forgeries under the real D's agent name, a first-contact stranger who knows the request id,
hellos that prove nothing or name an address P does not allow, /metrics without agent names or request ids,
and a heartbeat over 1 MiB naming live leases among ~30 000 ids. Runs on the shared pair (L = 6 s, max hold
12 s; :mod:`tests.shared_pair`): drop counts are compared as deltas."""

import re
import select
import socket
import time
from collections import Counter

import httpx
import pytest

from leasekit.chaos.peer import NixlPeer
from leasekit.chaos.workload import QueuedDecodeLoad
from leasekit.lease.codec import encode_heartbeat, encode_hello
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import TOKEN_PARAM, completion_tag, heartbeat_tag, hello_tag, parse_secret
from leasekit.telemetry import metrics as m
from leasekit.vllm.verdictchan import encode_hello_payload
from tests.integration.test_hostile_peer import lease, serves, wait_drops
from tests.scrape import labelled
from tests.shared_pair import L

pytestmark = pytest.mark.pair
UNKNOWN_IDS = "leasekit_kv_lease_heartbeat_unknown_ids_total"
BINDINGS = "leasekit_kv_lease_bindings_total"
DROPPED = m.NOTIFICATIONS_DROPPED.sample_names[0]
_seen: dict[str, set] = {"names": set(), "ids": set()}


@pytest.fixture(scope="module")
def pair(shared_pair):
    return shared_pair


def drops(pair) -> Counter:
    return labelled(pair.prefill.url, DROPPED, "reason")


def d_agent_name(pair) -> str:
    """The real D worker's NIXL agent name, from D's own start log line."""
    found = re.findall(r"LeaseKitConnector worker tp_rank=0 engine=\S+ NIXL agent (\S+) \(peer-",
                       pair.decode.log_path.read_text())
    assert found, "D's log names no NIXL agent"
    return found[-1]


def granted(pair):
    """A prefill on P (nobody decodes it yet): ``(request id, lease secret, kv_transfer_params)``."""
    result = pair.router.prefill(pair.prompt(32))
    assert result.ok, result
    secret = parse_secret(result.kv_transfer_params.get(TOKEN_PARAM))
    assert secret is not None, f"P's grant carries no lease secret: {result.kv_transfer_params}"
    _seen["ids"].add(result.request_id)
    return result.request_id, secret, result.kv_transfer_params


def peer(pair, name=None) -> NixlPeer:
    p = NixlPeer(name)
    p.p_agent = p.handshake("127.0.0.1", pair.prefill.side_channel_port)
    _seen["names"].add(p.name)
    return p


def test_forgeries_under_the_real_ds_agent_name_move_no_lease(pair):
    before = drops(pair)
    name = d_agent_name(pair)
    _seen["names"].add(name)
    load = QueuedDecodeLoad(pair, requests=1)
    load.start()
    rid = load.request_ids[0]
    _seen["ids"].add(rid)
    time.sleep(2.5)  # D heartbeats it with its tag (H = 1 s): the lease is proven
    with NixlPeer(name) as forger:  # a second process that calls its agent what the real D calls its own
        agent = forger.handshake("127.0.0.1", pair.prefill.side_channel_port)
        for message in (f"{rid}:1", f"{rid}~{'0' * 16}:1", f"HB:{rid}", f"HB:{rid}~{'1' * 16}"):
            forger.send(agent, message.encode())
        time.sleep(1.5)
    load.release_slot()
    assert load.wait_decodes(120)
    assert load.decodes[0].ok and len(load.decodes[0].token_ids) == load.decode_tokens
    timeline = lease(pair, rid)
    assert timeline.outcome == "released" and timeline.retrievals == 1
    assert timeline.end_s - timeline.grant_s > 3.5, "released by D's read, not by the forgery"
    got = wait_drops(pair, before + Counter({"unproven_completion": 2, "unproven_heartbeat": 2}))
    assert got["unproven_completion"] - before["unproven_completion"] >= 2
    assert got["unproven_heartbeat"] - before["unproven_heartbeat"] >= 2


def test_a_first_contact_stranger_who_knows_the_request_id_moves_no_lease(pair):
    before = drops(pair)
    rid, _secret, params = granted(pair)
    with peer(pair) as stranger:
        for _ in range(3):  # before the real D ever names the lease
            stranger.send(stranger.p_agent, f"{rid}:1".encode())
            stranger.send(stranger.p_agent, f"HB:{rid}".encode())
            time.sleep(0.2)
        result = pair.router.decode(pair.prompt(32), params, 4)
        assert result.ok and len(result.token_ids) == 4, result
        timeline = lease(pair, rid)
        assert timeline.outcome == "released" and timeline.retrievals == 1
        assert timeline.remote_agent != peer_ref(stranger.name)
    got = wait_drops(pair, before + Counter({"unproven_completion": 1}))
    assert got["unproven_completion"] - before["unproven_completion"] >= 1, "the held plain completion was voided"


class Listener:
    """A TCP port that records whether anyone connected (P must not)."""

    def __init__(self, host: str):
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.endpoint = f"tcp://{host}:{self.sock.getsockname()[1]}"

    def connected(self, within_s: float) -> bool:
        ready, _, _ = select.select([self.sock], [], [], within_s)
        return bool(ready)

    def close(self) -> None:
        self.sock.close()


def test_hellos_that_prove_nothing_or_name_a_disallowed_address_open_no_connection(pair):
    before = drops(pair)
    rid, secret, _params = granted(pair)
    allowed, elsewhere = Listener("127.0.0.1"), Listener("127.0.0.2")  # P served handshakes from 127.0.0.1 only
    token = "0123456789abcdef"
    unproven = encode_hello(encode_hello_payload(allowed.endpoint, token))
    forged = encode_hello(encode_hello_payload(allowed.endpoint, token, rid, "0" * 16))
    proven = encode_hello(encode_hello_payload(elsewhere.endpoint, token, rid,
                                               hello_tag(secret, elsewhere.endpoint, token)))
    try:
        with peer(pair) as stranger:
            for hello in (unproven, forged, proven):
                stranger.send(stranger.p_agent, hello)
            time.sleep(0.5)
            for message in (f"{rid}:1", "cmpl-guess-0:1", f"HB:{rid},LK1~7"):  # would draw a verdict or an ack
                stranger.send(stranger.p_agent, message.encode())
            got = wait_drops(pair, before + Counter({"unproven_hello": 2, "hello_not_allowed": 1}))
            assert got["unproven_hello"] - before["unproven_hello"] >= 2
            assert got["hello_not_allowed"] - before["hello_not_allowed"] >= 1
            assert not allowed.connected(2.0), "P connected on a hello that proved no lease"
            assert not elsewhere.connected(0.5), "P connected to an address it does not allow"
        serves(pair)
    finally:
        allowed.close()
        elsewhere.close()


def test_a_heartbeat_over_one_mib_extends_every_live_lease_it_names(pair):
    leases = [granted(pair) for _ in range(3)]
    before_unknown = sum(labelled(pair.prefill.url, UNKNOWN_IDS, "tp_rank").values())
    ids = [f"cmpl-{i:032x}-0~{i:016x}" for i in range(30000)]  # ~30 000 ids P never granted
    for k, (rid, secret, _) in enumerate(leases):
        ids.insert(10000 * k + 5000, f"{rid}~{heartbeat_tag(secret)}")
    message = encode_heartbeat(ids)
    assert len(message) > 1 << 20
    with peer(pair) as holder:
        until = time.monotonic() + L + 2
        while time.monotonic() < until:  # past the grants' L: only these heartbeats keep them
            holder.send(holder.p_agent, message)
            time.sleep(1.0)
        for rid, secret, _ in leases:  # end them by proof (a completion from the tag holder)
            holder.send(holder.p_agent, f"{rid}~{completion_tag(secret, 1)}:1".encode())
    serves(pair)
    for rid, _, _ in leases:
        timeline = lease(pair, rid)
        assert timeline.heartbeat_count >= L, f"{rid}: {timeline.heartbeat_count} extensions"
        assert timeline.outcome == "released", f"{rid} {timeline.outcome}: it had to outlive its L by the heartbeats"
        assert timeline.end_s - timeline.grant_s > L
    unknown = sum(labelled(pair.prefill.url, UNKNOWN_IDS, "tp_rank").values()) - before_unknown
    assert unknown >= 30000, f"unknown heartbeat ids counted: {unknown}"


def test_metrics_carry_no_agent_names_or_request_ids(pair):
    pair.router.generate(pair.prompt(8), 1)
    time.sleep(1.5)
    for server in (pair.prefill, pair.decode):
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "remote_agent" not in text
        for name in _seen["names"]:
            assert name not in text, f"agent name {name} on {server.url}/metrics"
        for rid in _seen["ids"]:
            assert rid not in text, f"request id {rid} on {server.url}/metrics"
    bindings = labelled(pair.prefill.url, BINDINGS, "proof")
    assert bindings["proven"] >= 1, bindings
