"""P's checks of push-mode registrations (leasekit/lease/pushreg.py): :func:`decode_push_reg` on registrations
encoded as vLLM's NixlPushConnector encodes them (``b"PUSH_REG:" + msgspec.msgpack.encode(reg_data)``,
``nixl/push_worker.py`` ``_do_send_reg_notif``), on each kind of malformed one, and on fuzzed bytes and maps;
:class:`PushRegGuard` with a fake clock (plain floats) and ``live`` / ``allowed`` backed by a dict and a set."""

import ipaddress
import re
import threading
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasekit.lease.pushreg import (
    BAD,
    DROP_REASONS,
    MAX_BLOCK_ID,
    MAX_ID_CHARS,
    MAX_TP_SIZE,
    NOT_ALLOWED,
    OVERFLOW,
    OVERSIZED,
    PUSH_REG_PREFIX,
    REPEAT,
    UNKNOWN_ID,
    PushReg,
    PushRegError,
    PushRegGuard,
    decode_push_reg,
)

MAX_BYTES = 1 << 16
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
USED = ("request_id", "decode_engine_id", "decode_host", "decode_port", "decode_tp_size", "local_block_ids")
_DELETE = object()


def reg_dict(**over):
    """A registration as vLLM's D builds it (``_send_registration_to_p``'s ``reg_data``); ``_DELETE`` drops a key."""
    reg = dict(request_id="cmpl-7f3a-0-1a2b3c4d", decode_engine_id="engine-d-0", decode_host="10.0.0.2",
               decode_port=5600, decode_tp_size=1, local_block_ids=[[1, 2, 3]], remote_engine_id="engine-p-0",
               remote_host="10.0.0.1", remote_port=5601, remote_tp_size=1, remote_pp_size=1)
    reg.update(over)
    return {k: v for k, v in reg.items() if v is not _DELETE}


def notif(**over) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(reg_dict(**over))


def decode(msg, max_bytes=MAX_BYTES, **kw):
    return decode_push_reg(msg, max_bytes=max_bytes, **kw)


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


def test_a_failing_callable_drops_that_registration_and_keeps_the_others():
    calls = []

    def live(rid):
        calls.append(rid)
        if rid == "boom":
            raise KeyError(rid)
        return rid

    guard = PushRegGuard(live=live, allowed=lambda host: True, hold_s=1.0, max_bytes=1 << 20)
    accepted, dropped = guard.filter([("d", notif(request_id="boom")), ("d", notif(request_id="ok"))], now=0.0)
    assert [lease for *_, lease in accepted] == ["ok"]
    assert [(reason, agent) for reason, agent, _ in dropped] == [("internal_error", "d")]


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


# --- decode_push_reg: fuzz ---------------------------------------------------------------------------------- #

@FUZZ
@given(payload=st.binary(max_size=400), max_bytes=st.integers(0, 500), prefixed=st.booleans())
def test_fuzz_bytes_never_raise(payload, max_bytes, prefixed):
    msg = (PUSH_REG_PREFIX if prefixed else b"") + payload
    out = decode_push_reg(msg, max_bytes=max_bytes)
    assert isinstance(out, (PushReg, PushRegError))
    if isinstance(out, PushRegError):
        assert out.reason in DROP_REASONS
        assert out.reason in (BAD, OVERSIZED)
        assert (out.reason == OVERSIZED) == (len(msg) > max_bytes)
    else:
        assert len(msg) <= max_bytes and prefixed


_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
            | st.binary(max_size=8) | st.sampled_from(["::1", "[::1]", "10.0.0.2", "localhost", "", "a\x00", "[::"])
            | st.integers(-2, 70000) | st.sampled_from([MAX_BLOCK_ID, MAX_BLOCK_ID + 1, MAX_TP_SIZE, 65535, 65536]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
_IDS = ["", "r\x7f", "r\x85", "r\n", "x" * (MAX_ID_CHARS + 1), "x" * MAX_ID_CHARS, 7, None, b"r"]
_FIELD_EDGES = {
    "request_id": _IDS, "decode_engine_id": _IDS,
    "decode_host": ["localhost", "example.com", "::1", "[::1]", "[::", "10.0.0.2%x", "10.0.0", "", 1, "10.0.0.2\n"],
    "decode_port": [True, False, 0, 1, -1, 65535, 65536, 1.0, "1"],
    "decode_tp_size": [True, 0, 1, MAX_TP_SIZE, MAX_TP_SIZE + 1, -1, 1.0],
    "local_block_ids": [[[-1]], [[MAX_BLOCK_ID + 1]], [[True]], [1, [2]], [[1], 2], [[1], [2]], [[MAX_BLOCK_ID]], [],
                        [[]], {"0": [1]}, [-1], [0]],
}
_one_field = st.sampled_from(USED).flatmap(lambda f: st.fixed_dictionaries(
    {f: st.one_of(st.sampled_from(_FIELD_EDGES[f]), st.sampled_from(_FIELD_EDGES[f]), _values, st.just(_DELETE))}))
_overrides = st.builds(
    lambda one, more: {**more, **one}, _one_field,
    st.dictionaries(st.sampled_from(USED + ("remote_host", "remote_port")) | st.text(max_size=8),
                    _values | st.just(_DELETE), max_size=3))


def _text_ok(v, limit):
    return isinstance(v, str) and 0 < len(v) <= limit and not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in v)


def _int_ok(v, low, high):
    return type(v) is int and low <= v <= high


def _blocks(v):
    """Block count of a valid ``local_block_ids`` (flat list or list of lists of ints), else None."""
    if not isinstance(v, list):
        return None
    groups = v if any(isinstance(g, list) for g in v) else [v]
    if not all(isinstance(g, list) and all(_int_ok(b, 0, MAX_BLOCK_ID) for b in g) for g in groups):
        return None
    return sum(len(g) for g in groups) or None  # a registration naming no block is refused


def _ip(text):
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _host_strictly_ok(v):
    """An IP literal exactly as vLLM's writer dials it (no brackets, no zone), or a host name."""
    return _text_ok(v, 64) and (("%" not in v and _ip(v)) or bool(re.fullmatch(
        r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
        v)))


@FUZZ
@given(over=_overrides)
def test_fuzz_maps_push_reg_only_when_fields_valid(over):
    reg = reg_dict(**over)
    msg = PUSH_REG_PREFIX + msgspec.msgpack.encode(reg)
    out = decode(msg)
    assert isinstance(out, (PushReg, PushRegError))
    others_ok = (_text_ok(reg.get("request_id"), MAX_ID_CHARS) and _text_ok(reg.get("decode_engine_id"), MAX_ID_CHARS)
                 and _int_ok(reg.get("decode_port"), 1, 65535) and _int_ok(reg.get("decode_tp_size"), 1, MAX_TP_SIZE)
                 and _blocks(reg.get("local_block_ids")) is not None)
    if isinstance(out, PushReg):  # only if every used field is valid
        assert others_ok
        assert _host_strictly_ok(reg["decode_host"]) and out.decode_host == reg["decode_host"]
        assert (out.request_id, out.decode_engine_id, out.decode_port, out.decode_tp_size, out.blocks) == (
            reg["request_id"], reg["decode_engine_id"], reg["decode_port"], reg["decode_tp_size"],
            _blocks(reg["local_block_ids"]))
    else:
        assert out.reason == BAD
        assert not (others_ok and _host_strictly_ok(reg.get("decode_host"))), (reg, out)
        assert out.detail.split(":")[0] in USED + ("not msgpack", "not a map")


# --- PushRegGuard ------------------------------------------------------------------------------------------- #

class World:
    """P's side as the guard sees it: ``leases`` maps a registration's request id to P's lease id (base-id
    matching is the ``live`` callable's job), ``hosts`` the addresses P may dial."""

    def __init__(self, leases=None, hosts=("10.0.0.2",)):
        self.leases = dict(leases or {})
        self.hosts = set(hosts)

    def guard(self, hold_s=2.0, max_held=8, max_bytes=MAX_BYTES, **kw):
        return PushRegGuard(live=self.leases.get, allowed=self.hosts.__contains__, hold_s=hold_s,
                            max_bytes=max_bytes, max_held=max_held, **kw)


def test_accepted_only_for_live_lease_carrying_live_lease_id():
    world = World({"cmpl-7f3a-0-1a2b3c4d": "cmpl-7f3a-0"})
    guard = world.guard()
    msg = notif()
    accepted, dropped = guard.filter([("agent-d0", msg)], now=100.0)
    assert dropped == []
    assert accepted == [("agent-d0", msg, decode(msg), "cmpl-7f3a-0")]
    assert guard.held == 0


def test_bad_registration_does_not_cost_the_rest_of_the_batch():
    world = World({"a": "A", "b": "B"})
    guard = world.guard()
    batch = [("d0", b"PUSH_REG:\xc1"), ("d0", notif(request_id="a")), ("d1", notif(decode_port=True)),
             ("d1", notif(request_id="b")), ("d2", notif(request_id="b", decode_port=0) + b"x" * MAX_BYTES)]
    accepted, dropped = guard.filter(batch, now=0.0)
    assert [(a, lease) for a, _, _, lease in accepted] == [("d0", "A"), ("d1", "B")]
    assert [(r, a) for r, a, _ in dropped] == [(BAD, "d0"), (BAD, "d1"), (OVERSIZED, "d2")]
    assert dropped[1][2].startswith("decode_port:")


@pytest.mark.parametrize("second_agent", ["d0", "d1"])
def test_second_registration_for_lease_is_repeat_until_forgotten(second_agent):
    world = World({"r1": "L1", "r1-deadbeef": "L1"})
    guard = world.guard()
    assert len(guard.filter([("d0", notif(request_id="r1"))], now=0.0)[0]) == 1
    # same lease under the same id or its suffixed form, same or another agent, later or in one batch
    accepted, dropped = guard.filter([(second_agent, notif(request_id="r1-deadbeef")),
                                      (second_agent, notif(request_id="r1", decode_port=7000))], now=1.0)
    assert accepted == []
    assert [(r, a) for r, a, _ in dropped] == [(REPEAT, second_agent)] * 2
    assert "L1" in dropped[0][2]
    assert guard.held == 0
    guard.forget("L1")
    guard.forget("never-seen")  # no error
    accepted, dropped = guard.filter([(second_agent, notif(request_id="r1"))], now=2.0)
    assert (dropped, [lease for *_, lease in accepted]) == ([], ["L1"])
    assert guard.filter([("d0", notif(request_id="r1"))], now=3.0)[1][0][0] == REPEAT


def test_forget_one_lease_keeps_the_other_matched():
    world = World({"r1": "L1", "r2": "L2"})
    guard = world.guard()
    guard.filter([("d0", notif(request_id="r1")), ("d0", notif(request_id="r2"))], now=0.0)
    guard.forget("L1")
    accepted, dropped = guard.filter([("d0", notif(request_id="r1")), ("d0", notif(request_id="r2"))], now=1.0)
    assert [lease for *_, lease in accepted] == ["L1"]
    assert [r for r, _, _ in dropped] == [REPEAT]


def test_unknown_id_held_then_accepted_when_lease_arrives():
    world = World()
    guard = world.guard(hold_s=2.0)
    msg = notif(request_id="r1")
    assert guard.filter([("d0", msg)], now=100.0) == ([], [])
    assert guard.held == 1
    assert guard.filter([], now=101.0) == ([], [])
    assert guard.held == 1
    world.leases["r1"] = "L1"
    accepted, dropped = guard.filter([], now=101.99)
    assert (accepted, dropped) == ([("d0", msg, decode(msg), "L1")], [])
    assert guard.held == 0
    assert guard.filter([], now=150.0) == ([], [])  # not decided twice


def test_unknown_id_dropped_when_hold_ends():
    world = World()
    guard = world.guard(hold_s=2.0)
    guard.filter([("d0", notif(request_id="r-lost"))], now=100.0)
    assert guard.filter([], now=101.999) == ([], [])
    accepted, dropped = guard.filter([], now=102.0)  # now >= first seen + hold_s
    assert accepted == []
    assert [(r, a) for r, a, _ in dropped] == [(UNKNOWN_ID, "d0")]
    assert "r-lost" in dropped[0][2]
    assert guard.held == 0
    world.leases["r-lost"] = "L"  # too late: it is gone
    assert guard.filter([], now=102.5) == ([], [])


def test_not_allowed_host_held_then_accepted_when_allowed():
    world = World({"r1": "L1"}, hosts=())
    guard = world.guard(hold_s=1.0)
    msg = notif(request_id="r1", decode_host="fd00::9")
    assert guard.filter([("d0", msg)], now=5.0) == ([], [])
    assert guard.held == 1
    world.hosts.add("fd00::9")
    accepted, _ = guard.filter([], now=5.5)
    assert [lease for *_, lease in accepted] == ["L1"]


def test_not_allowed_host_dropped_when_hold_ends():
    world = World({"r1": "L1"}, hosts={"10.0.0.2"})
    guard = world.guard(hold_s=1.0)
    guard.filter([("d0", notif(request_id="r1", decode_host="203.0.113.5"))], now=5.0)
    assert guard.filter([], now=5.9) == ([], [])
    accepted, dropped = guard.filter([], now=6.0)
    assert accepted == []
    assert [(r, a) for r, a, _ in dropped] == [(NOT_ALLOWED, "d0")]
    assert "203.0.113.5" in dropped[0][2]
    # the lease was not taken by the stranger: D's own registration is still accepted
    assert len(guard.filter([("d1", notif(request_id="r1"))], now=6.1)[0]) == 1


def test_drop_reason_is_the_last_rule_failed():
    world = World(hosts=())
    guard = world.guard(hold_s=1.0)
    guard.filter([("d0", notif(request_id="r1"))], now=0.0)
    world.leases["r1"] = "L1"
    assert guard.filter([], now=0.5) == ([], [])
    assert [r for r, _, _ in guard.filter([], now=1.0)[1]] == [NOT_ALLOWED]


def test_held_one_becomes_repeat_when_another_takes_the_lease():
    world = World(hosts=())
    guard = world.guard(hold_s=5.0)
    guard.filter([("stranger", notif(request_id="r1", decode_host="10.9.9.9"))], now=0.0)
    world.leases["r1"] = "L1"
    world.hosts.add("10.0.0.2")
    accepted, dropped = guard.filter([("d0", notif(request_id="r1"))], now=1.0)
    assert [(a, lease) for a, _, _, lease in accepted] == [("d0", "L1")]
    assert guard.held == 1  # the stranger's: still not allowed
    world.hosts.add("10.9.9.9")
    assert [(r, a) for r, a, _ in guard.filter([], now=2.0)[1]] == [(REPEAT, "stranger")]
    assert guard.held == 0


def test_held_ones_decided_before_the_new_batch():
    world = World()
    guard = world.guard()
    held_msg = notif(request_id="r1", decode_port=1111)
    guard.filter([("old", held_msg)], now=0.0)
    world.leases["r1"] = "L1"
    accepted, dropped = guard.filter([("new", notif(request_id="r1"))], now=0.5)
    assert [(a, m) for a, m, _, _ in accepted] == [("old", held_msg)]
    assert [(r, a) for r, a, _ in dropped] == [(REPEAT, "new")]


def test_hold_zero_drops_at_once():
    world = World()
    guard = world.guard(hold_s=0)
    accepted, dropped = guard.filter([("d0", notif(request_id="r1"))], now=3.0)
    assert (accepted, [r for r, _, _ in dropped], guard.held) == ([], [UNKNOWN_ID], 0)
    world.leases["r1"] = "L1"
    accepted, dropped = guard.filter([("d0", notif(request_id="r1", decode_host="10.1.1.1"))], now=3.0)
    assert (accepted, [r for r, _, _ in dropped], guard.held) == ([], [NOT_ALLOWED], 0)


def test_overflow_bounds_held():
    world = World({"live": "L"})
    guard = world.guard(hold_s=10.0, max_held=2)
    batch = [("d0", notif(request_id=f"r{i}")) for i in range(3)]
    accepted, dropped = guard.filter(batch, now=0.0)
    assert accepted == []
    assert [(r, a) for r, a, _ in dropped] == [(OVERFLOW, "d0")]
    assert guard.held == 2
    accepted, dropped = guard.filter([("d1", notif(request_id="r9")), ("d1", notif(request_id="live"))], now=1.0)
    assert [lease for *_, lease in accepted] == ["L"]  # a full hold does not stop an acceptable one
    assert [r for r, _, _ in dropped] == [OVERFLOW]
    assert guard.held == 2
    world.leases["r0"] = "L0"
    accepted, _ = guard.filter([], now=2.0)
    assert [lease for *_, lease in accepted] == ["L0"]
    assert guard.held == 1


@pytest.mark.parametrize("kw", [dict(hold_s=-0.001), dict(max_bytes=len(PUSH_REG_PREFIX)), dict(max_bytes=0),
                                dict(max_held=0), dict(max_held=-1)])
def test_constructor_refuses_bad_settings(kw):
    args = dict(hold_s=1.0, max_bytes=MAX_BYTES, max_held=4) | kw
    with pytest.raises(ValueError):
        PushRegGuard(live=lambda rid: None, allowed=lambda host: True, **args)


def test_constructor_accepts_smallest_settings():
    guard = PushRegGuard(live=lambda rid: None, allowed=lambda host: True, hold_s=0, max_bytes=10, max_held=1)
    assert (guard.hold_s, guard.max_bytes, guard.max_held, guard.held) == (0.0, 10, 1, 0)
    assert [r for r, _, _ in guard.filter([("d0", notif())], now=0.0)[1]] == [OVERSIZED]


def test_guard_uses_its_decoder():
    world = World({"r1": "L1"})
    guard = world.guard(decode=lambda data: reg_dict(request_id="r1"))
    accepted, dropped = guard.filter([("d0", PUSH_REG_PREFIX + b"anything")], now=0.0)
    assert (dropped, [lease for *_, lease in accepted]) == ([], ["L1"])


def test_filter_and_forget_from_two_threads():
    world = World({f"r{i}": f"L{i}" for i in range(8)})
    guard = world.guard(hold_s=0.05, max_held=4)
    msgs = [("d0", notif(request_id=f"r{i}")) for i in range(10)] + [("d0", b"PUSH_REG:\xc1")]
    errors, stop, counts = [], threading.Event(), [0, 0]

    def filterer():
        try:
            while not stop.is_set():
                accepted, dropped = guard.filter(msgs, now=time.monotonic())
                counts[0] += len(accepted)
                assert guard.held <= 4
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def forgetter():
        try:
            while not stop.is_set():
                for i in range(8):
                    guard.forget(f"L{i}")
                counts[1] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=filterer), threading.Thread(target=forgetter)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(timeout=2.0)
    assert errors == []
    assert not any(t.is_alive() for t in threads)
    assert counts[0] > 0 and counts[1] > 0


# --- PushRegGuard: fuzz ------------------------------------------------------------------------------------- #

_RIDS = ("r0", "r1", "r2", "r3")
_HOSTS = ("10.0.0.2", "10.0.0.3", "::1", "[::1]")
_good = st.builds(lambda rid, host, port: notif(request_id=rid, decode_host=host, decode_port=port),
                  st.sampled_from(_RIDS), st.sampled_from(_HOSTS), st.integers(1, 65535))
_msgs = _good | st.binary(max_size=60) | st.builds(lambda b: PUSH_REG_PREFIX + b, st.binary(max_size=60)) | \
    st.builds(lambda over: PUSH_REG_PREFIX + msgspec.msgpack.encode(reg_dict(**over)), _overrides)
_step = st.fixed_dictionaries({
    "batch": st.lists(st.tuples(st.sampled_from(["d0", "d1", "x"]), _msgs), max_size=6),
    "dt": st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    "live": st.dictionaries(st.sampled_from(_RIDS), st.sampled_from(["L0", "L1", "L2", None]), max_size=3),
    "hosts": st.lists(st.sampled_from(_HOSTS[:3]), max_size=3, unique=True),
    "forget": st.lists(st.sampled_from(["L0", "L1", "L2"]), max_size=2),
})


@FUZZ
@given(steps=st.lists(_step, min_size=1, max_size=6), hold_s=st.sampled_from([0.0, 1.0, 2.0]),
       max_held=st.integers(1, 4), max_bytes=st.sampled_from([10, 80, MAX_BYTES]))
def test_fuzz_guard_conserves_and_keeps_rules(steps, hold_s, max_held, max_bytes):
    world = World()
    guard = world.guard(hold_s=hold_s, max_held=max_held, max_bytes=max_bytes)
    now, taken = 0.0, set()
    for step in steps:
        now += step["dt"]
        for rid, lease in step["live"].items():
            if lease is None:
                world.leases.pop(rid, None)
            else:
                world.leases[rid] = lease
        world.hosts.clear()
        world.hosts.update(step["hosts"])
        for lease in step["forget"]:
            guard.forget(lease)
            taken.discard(lease)
        before = guard.held
        accepted, dropped = guard.filter(step["batch"], now=now)
        assert len(accepted) + len(dropped) + guard.held == len(step["batch"]) + before
        assert guard.held <= max_held
        for reason, agent, detail in dropped:
            assert reason in DROP_REASONS and isinstance(agent, str) and isinstance(detail, str)
        for agent, msg, reg, lease in accepted:
            assert (agent, msg) in step["batch"] or before > 0
            assert decode(msg, max_bytes=max_bytes) == reg
            assert world.leases.get(reg.request_id) == lease
            assert reg.decode_host in world.hosts
            assert lease not in taken, "a lease had two registrations acted on"
            taken.add(lease)
    if hold_s == 0:
        assert guard.held == 0


@pytest.mark.parametrize("host, allowed_as", [("localhost", "127.0.0.1"), ("LOCALHOST", "127.0.0.1"),
                                              ("d-0.decode.svc.cluster.local", None), ("10.0.0.256", None)])
def test_host_names_decode_but_only_localhost_can_pass_the_address_rule(host, allowed_as):
    """vLLM's default side-channel host is ``localhost``: checked as 127.0.0.1. Any other name is never allowed (P
    cannot tell where it leads without resolving it), whatever the allowlist holds."""
    reg = decode(notif(decode_host=host))
    assert isinstance(reg, PushReg) and reg.decode_host == host
    asked = []
    guard = PushRegGuard(live=lambda rid: "L", allowed=lambda a: asked.append(a) or True, hold_s=0.0,
                         max_bytes=1 << 20)
    accepted, dropped = guard.filter([("d", notif(decode_host=host))], now=0.0)
    if allowed_as is None:
        assert not accepted and dropped[0][0] == "push_reg_not_allowed" and asked == []
    else:
        assert [lease for *_, lease in accepted] == ["L"] and asked == [allowed_as]
