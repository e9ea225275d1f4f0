"""Fuzzed bytes and maps through decode_push_reg and fuzzed batches through PushRegGuard: no raise, rules kept."""

import ipaddress
import re

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasekit.lease.pushreg import (
    BAD,
    DROP_REASONS,
    MAX_BLOCK_ID,
    MAX_ID_CHARS,
    MAX_TP_SIZE,
    OVERSIZED,
    PUSH_REG_PREFIX,
    PushReg,
    PushRegError,
    decode_push_reg,
)
from tests.unit.pushreg_helpers import _DELETE, MAX_BYTES, USED, World, decode, notif, reg_dict

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
