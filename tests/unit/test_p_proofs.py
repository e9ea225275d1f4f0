"""P moves a protected lease only on proof: tags from the grant's secret, the claim window that keeps a
stranger's plain first contact from taking a lease, proven hellos to allowed addresses only, and large
heartbeats read id by id (leasekit.lease.proof, leasekit.lease.pkeeping, leasekit.vllm.prefill)."""

import time

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.binding import LeaseBinding
from leasekit.lease.codec import encode_completion, encode_heartbeat, encode_hello
from leasekit.lease.heartbeat_ids import decode_heartbeat_ids
from leasekit.lease.pkeeping import CLAIM_WAIT, PLAIN, PROVEN, PLeaseKeeping
from leasekit.lease.proof import (
    LeaseProofs,
    completion_tag,
    heartbeat_tag,
    hello_tag,
    lease_secret,
    new_engine_key,
    parse_secret,
    secret_text,
    split_tagged,
)
from leasekit.vllm.verdictchan import encode_hello_payload
from tests.unit.test_p_notifications import Worker

L = 6
TIMING = LeaseTiming.from_lease_duration(L)  # H = 1, E = 4: claim window L - E = 2 s
KEY = new_engine_key()


def tagged(req_id, key=KEY):
    return f"{req_id}~{heartbeat_tag(lease_secret(key, req_id))}"


def done_msg(req_id, n=1, key=KEY):
    return encode_completion(f"{req_id}~{completion_tag(lease_secret(key, req_id), n)}", n)


# -- the tags -------------------------------------------------------------------------------------------
def test_tags_are_per_lease_and_per_key_and_the_secret_round_trips_through_the_grant():
    t_a, t_b = lease_secret(KEY, "a"), lease_secret(KEY, "b")
    assert parse_secret(secret_text(t_a)) == t_a and len(secret_text(t_a)) == 32
    assert heartbeat_tag(t_a) != heartbeat_tag(t_b)
    assert heartbeat_tag(lease_secret(new_engine_key(), "a")) != heartbeat_tag(t_a)
    assert completion_tag(t_a, 1) != completion_tag(t_a, 2) != heartbeat_tag(t_a)
    assert hello_tag(t_a, "tcp://10.0.0.1:5", "0" * 16) != hello_tag(t_a, "tcp://10.0.0.2:5", "0" * 16)
    for bad in (None, 3, "", "A" * 32, "0" * 31, "g" * 32, secret_text(t_a) + "0"):
        assert parse_secret(bad) is None


def test_split_tagged_takes_the_last_separator_and_refuses_junk():
    tag = heartbeat_tag(lease_secret(KEY, "a~b"))
    assert split_tagged(f"a~b~{tag}") == ("a~b", tag)
    for plain in ("a", "a~", "~" + tag, f"a~{tag[:-1]}", f"a~{tag.upper()}", f"a~{tag}0"):
        assert split_tagged(plain) is None


# -- the keeping: proof, claim window ------------------------------------------------------------------
def keeping(key=KEY):
    kinds = []
    k = PLeaseKeeping(TIMING, max_hold_s=480.0, proofs=LeaseProofs(key), on_binding=kinds.append)
    return k, kinds


def test_a_tagged_heartbeat_proves_the_lease_and_then_no_plain_word_moves_it():
    k, kinds = keeping()
    k.grant("r", 0.0)
    tag = tagged("r").rsplit("~", 1)[1]
    assert k.heartbeat("r", "d0", 3.0, TIMING.extension_s, tag) == pytest.approx(7.0)
    assert kinds == [PROVEN]
    assert k.heartbeat("r", "d0", 4.0, TIMING.extension_s) == "unproven"  # plain, even from the same name
    assert k.heartbeat("r", "x", 4.0, TIMING.extension_s, "0" * 16) == "unproven"
    assert k.completion("r", "d0", 1, 4.0, granted=True, prefilled=False) == "unproven"
    assert k.completion("r", "x", 1, 4.0, granted=True, prefilled=False, tag="0" * 16) == "unproven"
    assert k.table.get("r").deadline_s == pytest.approx(7.0)
    good = completion_tag(lease_secret(KEY, "r"), 1)
    assert k.completion("r", "any-agent", 1, 5.0, granted=True, prefilled=False, tag=good) == "released"


def test_a_strangers_plain_first_contact_in_the_claim_window_moves_nothing():
    k, kinds = keeping()
    k.grant("r", 0.0)
    assert k.heartbeat("r", "stranger", 0.5, TIMING.extension_s) == CLAIM_WAIT
    assert "r" not in k.binding and kinds == []
    assert k.completion("r", "stranger", 1, 0.6, granted=True, prefilled=False) == CLAIM_WAIT
    assert k.table.get("r") is not None, "a plain completion in the window frees nothing"
    tag = tagged("r").rsplit("~", 1)[1]
    assert k.heartbeat("r", "d0", 1.0, TIMING.extension_s, tag) is not None  # the real D proves it
    assert k.due_plain(2.5) == [] and k.voided == 1
    assert k.table.get("r") is not None and kinds == [PROVEN]


def test_a_plain_completion_no_proof_contested_is_applied_when_the_window_ends():
    k, kinds = keeping()
    k.grant("r", 0.0)
    assert k.completion("r", "d0", 1, 0.3, granted=True, prefilled=False) == CLAIM_WAIT
    assert k.due_plain(1.9) == []
    assert k.due_plain(2.0) == [("r", "d0", 1)]
    assert k.completion("r", "d0", 1, 2.0, granted=True, prefilled=False) == "released"
    assert kinds == [PLAIN]


def test_a_plain_completion_held_for_a_lease_its_d_then_released_is_void_not_a_late_read():
    k, _ = keeping()
    k.grant("r", 0.0)
    assert k.completion("r", "stranger", 1, 0.2, granted=True, prefilled=False) == CLAIM_WAIT
    good = completion_tag(lease_secret(KEY, "r"), 1)
    assert k.completion("r", "d0", 1, 0.5, granted=True, prefilled=False, tag=good) == "released"
    assert k.voided == 1 and k.due_plain(5.0) == []


def test_past_the_window_a_plain_d_binds_as_stock_and_a_later_proof_takes_the_lease_over():
    k, kinds = keeping()
    k.grant("r", 0.0)
    assert k.heartbeat("r", "stock-d", 2.5, TIMING.extension_s) == pytest.approx(6.5)
    assert k.heartbeat("r", "other", 2.6, TIMING.extension_s) == "foreign"
    tag = tagged("r").rsplit("~", 1)[1]
    assert k.heartbeat("r", "d0", 3.0, TIMING.extension_s, tag) == pytest.approx(7.0)
    assert k.heartbeat("r", "stock-d", 3.1, TIMING.extension_s) == "unproven"
    assert kinds == [PLAIN, PROVEN]


def test_without_a_key_every_lease_is_plain_with_first_contact_binding():
    k, kinds = keeping(key=None)
    k.grant("r", 0.0)
    assert k.heartbeat("r", "d0", 0.5, TIMING.extension_s) == pytest.approx(6.0)
    assert k.completion("r", "x", 1, 0.6, granted=True, prefilled=False) == "foreign"
    assert k.heartbeat("r", "d0", 0.7, TIMING.extension_s, "0" * 16) == "unproven"  # nothing verifies
    assert k.completion("r", "d0", 1, 0.8, granted=True, prefilled=False) == "released"
    assert kinds == [PLAIN]


def test_the_simulated_step_reads_tagged_ids_and_held_plain_completions():
    k, _ = keeping()
    k.grant("r", 0.0)
    k.grant("s", 0.0)
    from leasekit.lease.codec import decode_notification
    result = k.step(1.0, [("d0", decode_notification(encode_heartbeat([tagged("r"), "s", "nope"]))),
                          ("x", decode_notification(encode_completion("s", 1)))])
    assert result.unknown_heartbeat_ids == ["nope"] and not result.ended
    result = k.step(2.0)
    assert [end.req_id for end in result.ended] == ["s"], "the held plain completion of s applies at 2 s"


def test_binding_prove_keeps_a_proven_leases_completion_state():
    b = LeaseBinding()
    assert b.heartbeat("r", "d0") is True
    assert b.prove("r", b"t" * 16) is True and b.bound_agent("r") is None and b.proven("r")
    assert b.completion("r", "d0", 2, proven=True) == "counted"
    assert b.prove("r", b"t" * 16) is False
    assert b.completion("r", "d1", 2, proven=True) == "released"


# -- the production intake ----------------------------------------------------------------------------
def proven_worker():
    w = Worker()
    w.keeping.proofs.key = KEY
    return w


def test_intake_a_forged_completion_claiming_the_real_ds_name_frees_nothing():
    w = proven_worker()
    now = time.perf_counter()
    w.grant("live", now - 3.0)  # past its claim window
    w.step({"d-real": [encode_heartbeat([tagged("live")])]})
    assert w.step({"d-real": [b"live:1"]}) == set()
    assert w.step({"d-real": [f"live~{'0' * 16}:1".encode()]}) == set()
    assert "live" in w.send
    assert w.drops() == {"unproven_completion": 2}
    assert w.step({"d-real": [done_msg("live")]}) == {"live"}


def test_intake_a_first_contact_stranger_frees_nothing_before_d_proves():
    w = proven_worker()
    w.grant("live", time.perf_counter())
    assert w.step({"stranger": [b"live:1", b"HB:live"]}) == set()
    assert w.step({"d-real": [encode_heartbeat([tagged("live")])]}) == set()
    w.intake.keeping._held_due[0] = (0.0, "live")  # its window ends now
    assert w.step({}) == set()
    assert "live" in w.send and w.drops() == {"unproven_completion": 1}


def test_intake_a_heartbeat_over_one_mib_extends_every_live_lease_it_names_and_counts_the_rest():
    w = proven_worker()
    now = time.perf_counter()
    live = [f"cmpl-{i:032x}-0" for i in range(8)]
    for req_id in live:
        w.grant(req_id, now - 3.0)
    ids = [f"cmpl-{i:032x}-0~{'0' * 16}" for i in range(100, 30100)]
    ids[5000:5000] = [tagged(r) for r in live]
    msg = encode_heartbeat(ids + ["", "bad\x01id"])
    assert len(msg) > 1 << 20
    before = {r: w.send[r] for r in live}
    w.step({"d-real": [msg]})
    assert all(w.send[r] > before[r] for r in live), "every live lease named must be extended"
    assert w.drops().get("bad_heartbeat_id") == 2
    from leasekit.vllm.stats import UNKNOWN_IDS
    assert sum(n for _, n in w.stats.data[UNKNOWN_IDS]) == 30000  # leasekit_kv_lease_heartbeat_unknown_ids_total


def test_decode_heartbeat_ids_drops_only_junk():
    assert decode_heartbeat_ids(b"HB:a,\xff,,b\x7f,c") == (("a", "c"), 3)
    assert decode_heartbeat_ids(b"HB:a," + b"x" * 1025) == (("a",), 1)
    assert decode_heartbeat_ids(b"HB:,,").reason == "empty_id"
    assert decode_heartbeat_ids(b"HB:a", max_bytes=3).reason == "oversized"


# -- hellos -------------------------------------------------------------------------------------------
def hello(req_id, endpoint="tcp://127.0.0.1:5999", token="0123456789abcdef", key=KEY, tag=None):
    tag = tag or hello_tag(lease_secret(key, req_id), endpoint, token)
    return encode_hello(encode_hello_payload(endpoint, token, req_id, tag))


def test_a_hello_that_proves_no_lease_opens_no_connection():
    w = proven_worker()
    w.replies.allow_peers(["127.0.0.1"])
    w.step({"stranger": [encode_hello(encode_hello_payload("tcp://127.0.0.1:5999", "0123456789abcdef"))]})
    w.step({"stranger": [hello("r", tag="0" * 16)]})
    w.step({"stranger": [hello("r", key=new_engine_key())]})
    assert w.replies.outbox is None and not w.replies.speaks("stranger")
    assert w.drops() == {"unproven_hello": 3}


def test_a_proven_hello_to_an_address_p_does_not_allow_opens_no_connection():
    w = proven_worker()
    w.replies.allow_peers(["10.1.2.3"])
    w.step({"d0": [hello("r")]})
    assert w.replies.outbox is None and w.drops() == {"hello_not_allowed": 1}
    w.replies.allow_peers(["127.0.0.1"])
    w.step({"d0": [hello("r")]})
    assert w.replies.speaks("d0")
    w.replies.close()


def test_a_plain_completion_gets_no_verdict_even_for_an_agent_that_said_hello():
    w = proven_worker()
    w.replies.allow_peers(["127.0.0.1"])
    w.grant("live", time.perf_counter() - 3.0)
    sent = []
    w.step({"d0": [hello("live"), encode_heartbeat([tagged("live")])]})
    w.replies._send = lambda agent, msg, ack=False: sent.append(msg)
    w.step({"d0": [b"guess:1", b"live:1"]})
    assert "live" in w.send
    assert sent == [], "an unproven completion must not make P tell anyone anything"
    w.step({"d0": [done_msg("live")]})
    assert sent == [b"LK1:V:ok:live"]
    w.replies.close()


# -- fuzz of the token and hello paths ----------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_hex = st.text("0123456789abcdef", min_size=0, max_size=20)
_rid = st.sampled_from(["live", "gone", "live~x", ""]) | st.text(max_size=8)
_forged = st.one_of(
    st.builds(lambda r, t: f"HB:{r}~{t}".encode(), _rid, _hex),
    st.builds(lambda r, t, n: f"{r}~{t}:{n}".encode(), _rid, _hex, st.integers(-1, 3)),
    st.builds(lambda r, t: encode_hello(encode_hello_payload("tcp://127.0.0.1:5999", "0123456789abcdef", r, t))
              if r and " " not in r and "\x00" not in r else b"HB:x", _rid, st.text("0123456789abcdef", min_size=16,
                                                                                     max_size=16)),
    st.builds(lambda b: b"HB:LK1~H~" + b, st.binary(max_size=40)),
    st.builds(lambda p: encode_hello(p) if len(p) < 700 else b"HB:y", st.binary(max_size=80)),
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(_forged, min_size=1, max_size=20))
def test_fuzzed_tags_and_hellos_never_raise_move_a_proven_lease_or_open_a_connection(batch):
    w = proven_worker()
    w.replies.allow_peers(["127.0.0.1"])
    now = time.perf_counter()
    w.grant("live", now - 3.0)
    w.step({"d-real": [encode_heartbeat([tagged("live")])]})
    deadline = w.send["live"]
    done = w.step({"forger": batch, "d-real": batch})
    assert "live" in w.send and "live" not in done
    assert w.send["live"] <= deadline + 0.5, "a forged heartbeat must not extend"
    assert w.replies.outbox is None, "no connection on an unproven hello"
    assert "internal_error" not in w.drops()


def test_one_address_flooding_handshakes_cannot_push_a_ds_address_off_the_allowlist():
    from leasekit.vllm.prefill.listener import MAX_NEW_PEERS, ListenerHealth
    health = ListenerHealth()
    health.peer_served("10.0.0.5")  # the real D
    for _ in range(3 * MAX_NEW_PEERS):
        health.peer_served("10.9.9.9")
    assert set(health.take_peers()) == {"10.0.0.5", "10.9.9.9"}
    assert health.take_peers() == []


def test_a_sequenced_heartbeat_that_extends_nothing_gets_no_ack():
    w = proven_worker()
    w.replies.allow_peers(["127.0.0.1"])
    w.grant("live", time.perf_counter() - 3.0)
    w.step({"d0": [hello("live")]})
    sent = []
    w.replies._send = lambda agent, msg, ack=False: sent.append(msg)
    w.step({"d0": [b"HB:LK1~5", b"HB:nope,LK1~6", f"HB:live~{'0' * 16},LK1~7".encode()]})  # nothing, unknown, forged
    assert sent == []
    w.step({"d0": [encode_heartbeat([tagged("live"), "LK1~8"])]})
    assert len(sent) == 1 and sent[0].startswith(b"LK1:A:8:")
    w.replies.close()
