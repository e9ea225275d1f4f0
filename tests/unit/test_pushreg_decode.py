"""decode_push_reg on registrations encoded as vLLM's NixlPushConnector encodes them, and on each malformed kind."""

import msgspec
import pytest

from leasekit.lease.pushreg import (
    BAD,
    MAX_BLOCK_ID,
    MAX_ID_CHARS,
    MAX_TP_SIZE,
    OVERSIZED,
    PUSH_REG_PREFIX,
    PushReg,
    PushRegError,
    decode_push_reg,
)
from tests.unit.pushreg_helpers import _DELETE, USED, decode, notif, reg_dict


# --- decode_push_reg: well-formed --------------------------------------------------------------------------- #

@pytest.mark.parametrize("blocks, count", [([[1, 2, 3]], 3), ([[0, 5], [7, 8, 9]], 5), ([4, 5, 6, 7], 4),
                                           ([[0, MAX_BLOCK_ID]], 2)])
def test_well_formed_decodes(blocks, count):
    reg = decode(notif(local_block_ids=blocks))
    assert reg == PushReg(request_id="cmpl-7f3a-0-1a2b3c4d", decode_engine_id="engine-d-0", decode_host="10.0.0.2",
                          decode_port=5600, decode_tp_size=1, blocks=count)


def test_accepts_bytearray_and_memoryview_and_extra_fields():
    msg = notif(extra={"a": [1, 2]}, **{"7": None})
    assert isinstance(decode(bytearray(msg)), PushReg)
    assert decode(memoryview(msg)) == decode(msg)


@pytest.mark.parametrize("field, value", [
    ("decode_port", 1), ("decode_port", 65535), ("decode_tp_size", 1), ("decode_tp_size", MAX_TP_SIZE),
    ("request_id", "x" * MAX_ID_CHARS), ("decode_engine_id", "é" * MAX_ID_CHARS), ("request_id", "r"),
])
def test_range_edges_accepted(field, value):
    reg = decode(notif(**{field: value}))
    assert isinstance(reg, PushReg), reg
    assert getattr(reg, field) == value


@pytest.mark.parametrize("host", ["::1", "2001:db8::7", "192.168.1.20"])
def test_ip_literals_accepted_as_vllm_dials_them(host):
    reg = decode(notif(decode_host=host))
    assert isinstance(reg, PushReg), reg
    assert reg.decode_host == host


@pytest.mark.parametrize("host", ["[::1]", "[2001:db8::7]", "1.2.3.4]]", "[::1", "1.2.3.4%evil", "fe80::1%eth0"])
def test_a_host_that_differs_from_what_vllm_would_dial_is_refused(host):
    """The guard checks the address vLLM's writer dials (the raw field): nothing is stripped first."""
    reg = decode(notif(decode_host=host))
    assert isinstance(reg, PushRegError) and reg.reason == BAD and reg.detail.startswith("decode_host:"), reg


@pytest.mark.parametrize("blocks", [[], [[]], [[], []]])
def test_a_registration_naming_no_block_is_refused(blocks):
    reg = decode(notif(local_block_ids=blocks))
    assert isinstance(reg, PushRegError) and reg.detail.startswith("local_block_ids:"), reg


def test_size_ceiling_counts_bytes_of_a_memoryview():
    raw = notif()
    view = memoryview(bytearray(raw + b"\0" * (-len(raw) % 8))).cast("Q")
    assert len(view) < view.nbytes
    assert decode_push_reg(view, max_bytes=len(view)).reason == OVERSIZED


def test_size_ceiling_is_inclusive():
    msg = notif()
    assert isinstance(decode(msg, max_bytes=len(msg)), PushReg)
    assert decode(msg, max_bytes=len(msg) - 1).reason == OVERSIZED


# --- decode_push_reg: refusals ------------------------------------------------------------------------------ #

def test_oversized_refused_before_decoding():
    calls = []

    def decoder(data):
        calls.append(data)
        raise AssertionError("decoder called on an oversized registration")

    msg = notif(local_block_ids=[list(range(200))])
    err = decode(msg, max_bytes=len(msg) - 1, decode=decoder)
    assert isinstance(err, PushRegError)
    assert err.reason == OVERSIZED
    assert str(len(msg)) in err.detail
    assert calls == []


@pytest.mark.parametrize("msg, words", [
    (PUSH_REG_PREFIX, "not msgpack"),
    (PUSH_REG_PREFIX + b"\xc1", "not msgpack"),                          # never-used msgpack byte
    (PUSH_REG_PREFIX + b"\x82\xa1", "not msgpack"),                      # truncated map
    (PUSH_REG_PREFIX + msgspec.msgpack.encode(reg_dict()) + b"\x00", "not msgpack"),  # trailing byte
    (PUSH_REG_PREFIX + msgspec.msgpack.encode([1, 2]), "not a map"),
    (PUSH_REG_PREFIX + msgspec.msgpack.encode("cmpl-1"), "not a map"),
    (PUSH_REG_PREFIX + msgspec.msgpack.encode(None), "not a map"),
    (b"PUSH_RE:" + msgspec.msgpack.encode(reg_dict()), "prefix"),
    ("PUSH_REG:" + "x", "not bytes"),
    (None, "not bytes"),
])
def test_not_a_registration_refused(msg, words):
    err = decode(msg)
    assert isinstance(err, PushRegError)
    assert err.reason == BAD
    assert words in err.detail


def test_decoder_exception_is_a_refusal():
    def decoder(data):
        raise RecursionError("deep")

    err = decode(notif(), decode=decoder)
    assert err == PushRegError(BAD, "not msgpack: RecursionError")


BAD_FIELDS = [(f, _DELETE) for f in USED] + [
    ("request_id", 5), ("request_id", b"cmpl-1"), ("request_id", None), ("request_id", ""),
    ("request_id", "x" * (MAX_ID_CHARS + 1)), ("request_id", ["cmpl-1"]),
    ("request_id", "cmpl\x00-1"), ("request_id", "cmpl-1\n"), ("request_id", "\x1bcmpl"), ("request_id", "a\x7f"),
    ("request_id", "a\x85b"),
    ("decode_engine_id", 7), ("decode_engine_id", ""), ("decode_engine_id", "eng\td"),
    ("decode_host", 167772162), ("decode_host", ""), ("decode_host", "10.0.0.2\n"), ("decode_host", "-bad.example"),
    ("decode_host", "a..b"), ("decode_host", "under_score.example"),
    ("decode_host", "1" * 65), ("decode_host", "[]"), ("decode_host", " 10.0.0.2"),
    ("decode_port", 0), ("decode_port", 65536), ("decode_port", -1), ("decode_port", 2**64 - 1),
    ("decode_port", True), ("decode_port", "5600"), ("decode_port", 5600.0), ("decode_port", None),
    ("decode_tp_size", 0), ("decode_tp_size", MAX_TP_SIZE + 1), ("decode_tp_size", True), ("decode_tp_size", 1.0),
    ("decode_tp_size", -1),
    ("local_block_ids", "1,2,3"), ("local_block_ids", 3), ("local_block_ids", {"0": [1]}), ("local_block_ids", None),
    ("local_block_ids", [[1, 2], [-1]]), ("local_block_ids", [[2**31]]), ("local_block_ids", [2**31]),
    ("local_block_ids", [[1], [2, "3"]]), ("local_block_ids", [[1], 2]), ("local_block_ids", [1, [2]]),
    ("local_block_ids", [[1.0]]), ("local_block_ids", [[True]]), ("local_block_ids", [False]),
    ("local_block_ids", [[None]]), ("local_block_ids", [[[1]]]),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v!r}"[:60] for f, v in BAD_FIELDS])
def test_bad_field_refused_naming_it(field, value):
    err = decode(notif(**{field: value}))
    assert isinstance(err, PushRegError), err
    assert err.reason == BAD
    assert err.detail.startswith(f"{field}:"), err.detail


def test_true_is_not_port_one():
    # msgpack keeps booleans apart from integers; Python's True == 1 must not let one through.
    assert isinstance(decode(notif(decode_port=1)), PushReg)
    assert decode(notif(decode_port=True)).reason == BAD


def test_first_bad_field_reported_other_fields_unread():
    err = decode(notif(request_id=_DELETE, decode_port=0))
    assert err.detail.startswith("request_id:")
