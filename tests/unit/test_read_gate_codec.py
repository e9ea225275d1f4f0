"""The fail-closed protocol's LK1 codec: verdicts, hellos, acks and sequence tokens round-trip; stock ones unchanged."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease.codec import (
    REASON_BAD_PROTOCOL,
    Completion,
    DecodeError,
    Verdict,
    decode_notification,
    encode_ack,
    encode_completion,
    encode_hello,
    encode_verdict,
    sequence_token,
    split_protocol_ids,
)
from leasekit.lease.readgate import agent_name

_ID = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=64)


@given(_ID, st.booleans())
def test_verdict_round_trips_for_any_id(req_id, ok):
    assert decode_notification(encode_verdict(req_id, ok)) == Verdict(req_id, ok)


@given(st.binary(min_size=1, max_size=600))
def test_hello_is_a_heartbeat_id_that_round_trips_any_payload(payload):
    heartbeat = decode_notification(encode_hello(payload))
    assert split_protocol_ids(heartbeat.req_ids) == (None, payload, ())  # a stock P ignores the id


@pytest.mark.parametrize("raw", [b"LK1:", b"LK1:V:maybe:r", b"LK1:V:ok", b"LK1:HELLO:!!!", b"LK1:HELLO:", b"LK1:X:1"])
def test_malformed_protocol_messages_are_bad_protocol(raw):
    result = decode_notification(raw)
    assert isinstance(result, DecodeError) and result.reason == REASON_BAD_PROTOCOL


def test_stock_messages_are_unchanged_by_the_protocol():
    assert decode_notification(encode_completion("cmpl-1:x", 2)) == Completion("cmpl-1:x", 2)


def test_agent_names_from_vllm_bytes_and_nixl_str_agree():
    assert agent_name(b"abc") == agent_name("abc") == "abc"


@given(st.integers(0, 10**9), st.floats(0, 1e5), st.lists(_ID.filter(lambda i: "," not in i), max_size=5))
def test_ack_round_trips(seq, remaining_s, ids):
    ack = decode_notification(encode_ack(seq, remaining_s, ids))
    assert (ack.seq, ack.req_ids) == (seq, tuple(ids)) and ack.remaining_s <= remaining_s


def test_sequence_token_is_split_off_a_heartbeat():
    assert split_protocol_ids(["a", sequence_token(12), "b"]) == (12, None, ("a", "b"))
    assert split_protocol_ids(["a", "LK1~x", "LK1~H~!!"]) == (None, None, ("a", "LK1~x", "LK1~H~!!"))
