"""PushRegGuard with a fake clock: live-lease matching, repeats, holding and dropping, overflow, settings, threads."""

import threading
import time

import pytest

from leasekit.lease.pushreg import (
    BAD,
    NOT_ALLOWED,
    OVERFLOW,
    OVERSIZED,
    PUSH_REG_PREFIX,
    REPEAT,
    UNKNOWN_ID,
    PushReg,
    PushRegGuard,
)
from tests.unit.pushreg_helpers import MAX_BYTES, World, decode, notif, reg_dict


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
