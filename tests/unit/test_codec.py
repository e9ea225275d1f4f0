"""NIXL notification codecs: byte-identical to vLLM 0.32.0, and a decoder that never raises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease.codec import (
    DECODE_ERROR_REASONS,
    MAX_EXPECTED_CONSUMERS,
    REASON_BAD_COUNT,
    REASON_BAD_ID,
    REASON_EMPTY,
    REASON_EMPTY_ID,
    REASON_NO_COLON,
    REASON_NOT_BYTES,
    REASON_NOT_UTF8,
    REASON_OVERSIZED,
    Completion,
    DecodeError,
    Heartbeat,
    NotificationCounters,
    decode_notification,
    encode_completion,
    encode_heartbeat,
)

# Request ids as the wire allows them: no ',' (heartbeat separator), no control characters, not empty.
# ':' is allowed (completion decoding uses rsplit, as vLLM does).
_ID_ALPHABET = st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters=",")
req_ids = st.text(_ID_ALPHABET, min_size=1, max_size=64)


def _vllm_p_side(msg: bytes):
    """Stock vLLM P's parsing (nixl/pull_worker.py: _get_new_notifs), for byte-level comparison."""
    text = msg.decode("utf-8")
    if text.startswith("HB:"):
        return ("hb", text[3:].split(","))
    req_id, n = text.rsplit(":", 1)
    return ("done", req_id, int(n))


def test_heartbeat_bytes_equal_vllms_expression():
    ids = ["cmpl-a-0-1f2e", "cmpl-b-0-9c3d", "cmpl-c-0-77aa"]
    assert encode_heartbeat(ids) == ("HB:" + ",".join(ids)).encode() == b"HB:cmpl-a-0-1f2e,cmpl-b-0-9c3d,cmpl-c-0-77aa"
    assert encode_heartbeat(iter(ids)) == encode_heartbeat(ids)  # any iterable; order kept
    assert encode_heartbeat(["b", "a"]) == b"HB:b,a"


def test_completion_bytes_equal_vllms_fstring():
    remote_request_id, expected_consumers = "cmpl-x-0-abc", 2
    assert encode_completion(remote_request_id, expected_consumers) == f"{remote_request_id}:{expected_consumers}".encode()
    assert encode_completion("r", 1) == b"r:1"


def test_encode_heartbeat_refuses_a_bare_string():
    with pytest.raises(TypeError):
        encode_heartbeat("abc")  # would silently be HB:a,b,c


def test_round_trips():
    assert decode_notification(encode_heartbeat(["a", "b"])) == Heartbeat(("a", "b"))
    assert decode_notification(encode_completion("cmpl-x-0-abc", 4)) == Completion("cmpl-x-0-abc", 4)


def test_rsplit_semantics_match_vllm():
    assert decode_notification(b"a:b:2") == Completion("a:b", 2)
    assert _vllm_p_side(b"a:b:2") == ("done", "a:b", 2)
    # startswith("HB:") is tested first, so a colon inside a heartbeat stays in the id.
    assert decode_notification(b"HB:x:3") == Heartbeat(("x:3",))
    assert decode_notification(b"HB:a,b,a") == Heartbeat(("a", "b", "a"))  # duplicates kept, order kept


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\xff\xfe\xfd", REASON_NOT_UTF8),  # UnicodeDecodeError in stock P
        (b"abc", REASON_NO_COLON),  # ValueError: not enough values to unpack
        (b"cmpl-x-0-abc:x", REASON_BAD_COUNT),  # ValueError: invalid literal for int()
    ],
)
def test_payloads_that_crash_stock_vllm_p_are_decode_errors(payload, reason):
    with pytest.raises((UnicodeDecodeError, ValueError)):
        _vllm_p_side(payload)
    result = decode_notification(payload)
    assert isinstance(result, DecodeError)
    assert result.reason == reason
    assert result.detail


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", REASON_EMPTY),
        (b"HB", REASON_NO_COLON),
        (b"HB:", REASON_EMPTY_ID),
        (b"HB:a,,b", REASON_EMPTY_ID),
        (b"HB:a,", REASON_EMPTY_ID),
        (b":2", REASON_EMPTY_ID),
        (b"r:", REASON_BAD_COUNT),
        (b"r:0", REASON_BAD_COUNT),
        (b"r:-1", REASON_BAD_COUNT),
        (b"r:+2", REASON_BAD_COUNT),
        (b"r: 2", REASON_BAD_COUNT),
        (b"r:2_0", REASON_BAD_COUNT),
        ("r:\u0663".encode(), REASON_BAD_COUNT),  # Arabic-Indic 3: int() takes it, we do not
        (b"r:1.5", REASON_BAD_COUNT),
        (f"r:{MAX_EXPECTED_CONSUMERS + 1}".encode(), REASON_BAD_COUNT),
        (b"r:" + b"9" * 5000, REASON_BAD_COUNT),  # int() itself raises past 4300 digits
        (b"r\x00x:1", REASON_BAD_ID),
        (b"r\nx:1", REASON_BAD_ID),
        ("r\u0085:1".encode(), REASON_BAD_ID),  # C1 control
        (b"HB:a,b\x7f", REASON_BAD_ID),
        (b"HB:" + b"a" * 1025, REASON_BAD_ID),
        (b"\xed\xa0\x80:1", REASON_NOT_UTF8),  # an encoded surrogate is not UTF-8
    ],
)
def test_malformed_notifications(payload, reason):
    result = decode_notification(payload)
    assert isinstance(result, DecodeError), result
    assert result.reason == reason
    assert result.reason in DECODE_ERROR_REASONS


def test_edges_that_are_accepted():
    assert decode_notification(f"r:{MAX_EXPECTED_CONSUMERS}".encode()) == Completion("r", MAX_EXPECTED_CONSUMERS)
    assert decode_notification(b"HB:" + b"a" * 1024) == Heartbeat(("a" * 1024,))
    assert decode_notification(b"r:02") == Completion("r", 2)  # base-10 with a leading zero, as int()
    assert decode_notification(("é" * 2000 + ":1").encode()) == Completion("é" * 2000, 1)  # no length cap
    assert decode_notification(bytearray(b"r:1")) == Completion("r", 1)
    assert decode_notification(memoryview(b"HB:a")) == Heartbeat(("a",))


def test_oversized_is_checked_before_decoding():
    assert decode_notification(b"r:1", max_bytes=3) == Completion("r", 1)
    result = decode_notification(b"\xff" * 4, max_bytes=3)  # not UTF-8 either: size wins
    assert isinstance(result, DecodeError) and result.reason == REASON_OVERSIZED
    big = encode_heartbeat(["x" * 100] * 20_000)  # ~2 MB
    assert decode_notification(big).reason == REASON_OVERSIZED


@pytest.mark.parametrize("value", ["r:1", None, 12, ["HB:a"]])
def test_non_bytes_input_is_a_decode_error(value):
    result = decode_notification(value)
    assert isinstance(result, DecodeError) and result.reason == REASON_NOT_BYTES


_texts = st.text(max_size=80)
notification_like = st.one_of(
    st.binary(max_size=512),
    _texts.map(str.encode),
    st.builds(lambda a, b: f"{a}:{b}".encode(), _texts, st.one_of(_texts, st.integers().map(str))),
    st.builds(lambda ids: ("HB:" + ",".join(ids)).encode(), st.lists(_texts, max_size=5)),
)


@given(notification_like)
def test_decode_never_raises(msg):
    result = decode_notification(msg)
    assert isinstance(result, (Heartbeat, Completion, DecodeError))
    if isinstance(result, DecodeError):
        assert result.reason in DECODE_ERROR_REASONS
    else:  # whatever we accept, stock vLLM parses the same way
        vllm = _vllm_p_side(msg)
        if isinstance(result, Heartbeat):
            assert vllm == ("hb", list(result.req_ids))
        else:
            assert vllm == ("done", result.req_id, result.expected_consumers)


@given(st.binary(max_size=64), st.integers(min_value=0, max_value=64))
def test_decode_never_raises_with_any_ceiling(msg, max_bytes):
    assert isinstance(decode_notification(msg, max_bytes=max_bytes), (Heartbeat, Completion, DecodeError))


@given(st.lists(req_ids, min_size=1, max_size=20))
def test_heartbeat_round_trip(ids):
    assert decode_notification(encode_heartbeat(ids)) == Heartbeat(tuple(ids))


@given(req_ids, st.integers(min_value=1, max_value=MAX_EXPECTED_CONSUMERS))
def test_completion_round_trip(req_id, n):
    if req_id.startswith("HB:"):  # vLLM would read it as a heartbeat too
        assert isinstance(decode_notification(encode_completion(req_id, n)), Heartbeat)
    else:
        assert decode_notification(encode_completion(req_id, n)) == Completion(req_id, n)


def test_counters():
    counters = NotificationCounters()
    for msg in [b"HB:a,b", b"HB:c", b"r:1", b"\xff", b"abc", b"abc", b"r:x"]:
        counters.record(decode_notification(msg))
    snapshot = counters.as_dict()
    assert snapshot["heartbeat"] == 2 and snapshot["heartbeat_ids"] == 3 and snapshot["completion"] == 1
    assert snapshot["error"][REASON_NOT_UTF8] == 1
    assert snapshot["error"][REASON_NO_COLON] == 2
    assert snapshot["error"][REASON_BAD_COUNT] == 1
    assert set(snapshot["error"]) == set(DECODE_ERROR_REASONS)  # every label present, zeros included
    counters.record(Completion("r", 1))
    assert snapshot["completion"] == 1  # as_dict is a snapshot
    with pytest.raises(TypeError):
        counters.record("not a result")
