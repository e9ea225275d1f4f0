"""P side: vLLM 0.32.0's lease code and leasekit's PLeaseTable agree step by step on scripts, or differ as D1-D7, D9."""

from __future__ import annotations

import random

import pytest

from leasekit.lease.codec import (
    REASON_BAD_COUNT,
    REASON_BAD_ID,
    REASON_EMPTY,
    REASON_EMPTY_ID,
    REASON_NO_COLON,
    REASON_NOT_UTF8,
    Completion,
    DecodeError,
    decode_notification,
)
from tests import vllm_replay as R
from tests.unit.differential_vllm_helpers import config, v  # noqa: F401 - module-scoped fixtures the tests request

EPOCH = 4096.0  # P scheduler's perf_counter epoch relative to the worker's (exact in binary)
P_DURATIONS = (6, 12, 30, 7.5)
P_SEEDS = 25  # per L: 100 P scripts


class Pair:
    """The same P script through vLLM and through leasekit (and leasekit counting messages)."""

    def __init__(self, v, config, L, *, t0=100.0):
        self.clock = R.ManualClock(t0)
        self.vllm = R.VllmP(v, config(L, "kv_producer"), L, self.clock, scheduler_epoch_offset=EPOCH)
        self.model = R.ModelP(L)
        self.anonymous = R.ModelP(L, anonymous=True)

    def step(self, t, **kw):
        step = R.PStep(t, **kw)
        return self.vllm.step(step), self.model.step(step), self.anonymous.step(step)

    @property
    def worker(self):
        return self.vllm.worker

    @property
    def table(self):
        return self.model.table


@pytest.fixture
def pair(v, config):
    return lambda L=12, **kw: Pair(v, config, L, **kw)


# --------------------------------------------------------------------------------------------
# 1. P side: random scripts agree step by step
# --------------------------------------------------------------------------------------------
def _replay_p(v, config, L, script):
    vp = R.VllmP(v, config(L, "kv_producer"), L, R.ManualClock(), scheduler_epoch_offset=EPOCH)
    model, anonymous = R.ModelP(L), R.ModelP(L, anonymous=True)
    rows = [(s, vp.step(s), model.step(s), anonymous.step(s)) for s in script]
    return vp, model, anonymous, rows


@pytest.mark.parametrize("L", P_DURATIONS, ids=lambda L: f"L={L!r}")
def test_p_random_scripts_agree_step_by_step(v, config, L):
    seen = {"released": 0, "expired": 0, "expired_on_the_instant": 0, "extended": 0, "partial": 0, "late": 0}
    for seed in range(P_SEEDS):
        script = R.random_p_script(random.Random(f"p-{L!r}-{seed}"), L)
        vp, model, _, rows = _replay_p(v, config, L, script)
        before: dict = {}
        for i, (step, got_vllm, got_model, _) in enumerate(rows):
            where = f"L={L!r} seed={seed} step={i} t={step.t} {step}"
            assert got_model.live == got_vllm.live, f"live leases / deadlines differ at {where}"
            assert got_model.released == got_vllm.released, f"released sets differ at {where}"
            assert got_model.expired == got_vllm.expired, f"reaped sets differ at {where}"
            assert got_model.counted == got_vllm.counted, f"completion counts differ at {where}"
            w = vp.worker
            assert set(w.consumer_notification_counts_by_req) <= w._reqs_to_process, where
            assert set(w._reqs_to_send) <= w._reqs_to_process, where
            seen["released"] += len(got_vllm.released)
            seen["expired"] += len(got_vllm.expired)
            seen["expired_on_the_instant"] += sum(before.get(r) == step.t for r in got_vllm.expired)
            seen["extended"] += sum(r in before and d > before[r] for r, d in got_vllm.live.items())
            seen["partial"] += len(got_vllm.counted)
            before = got_vllm.live
        assert rows[-1][1].live == {} and model.table.leases() == []  # conservation: all end
        assert vp.counters()["expired"] == model.table.counters["expired"]
        late = vp.counters()["notifications_after_expiry"]
        assert late == model.table.counters["late_completions"] and model.table.counters["buffered_completions"] == 0
        seen["late"] += late
        assert model.errors == []
    # the scripts are not vacuous: every path was taken, and deadlines were hit on the instant
    assert all(n >= 5 for n in seen.values()), seen


def test_p_random_scripts_with_duplicate_senders_differ_only_as_d1(v, config):
    """D1 on random scripts: counting messages (model with senders hidden) is vLLM exactly; the model
    proper differs only on leases that got a repeated completion from one rank, and frees them later."""
    differing = 0
    for L, seed in ((L, seed) for L in P_DURATIONS for seed in range(5)):
        script = R.random_p_script(random.Random(f"dup-{L!r}-{seed}"), L, duplicate_senders=True)
        dup_ids = set()
        senders: dict = {}
        for step in script:
            for agent, msgs in step.notifs.items():
                for msg in msgs:
                    if not msg.startswith(b"HB:"):
                        rid = msg.decode().rsplit(":", 1)[0]
                        if agent in senders.setdefault(rid, set()):
                            dup_ids.add(rid)
                        senders[rid].add(agent)
        _, _, _, rows = _replay_p(v, config, L, script)
        freed_vllm: dict = {}
        freed_model: dict = {}
        for i, (step, got_vllm, got_model, got_anonymous) in enumerate(rows):
            where = f"L={L!r} seed={seed} step={i}"
            assert got_anonymous == got_vllm, f"message counting != vLLM at {where}"
            clean = lambda ids: {r for r in ids if r not in dup_ids}  # noqa: E731
            assert clean(got_model.released) == clean(got_vllm.released), where
            assert clean(got_model.expired) == clean(got_vllm.expired), where
            assert {r: d for r, d in got_model.live.items() if r not in dup_ids} == \
                   {r: d for r, d in got_vllm.live.items() if r not in dup_ids}, where
            for r in got_vllm.released | got_vllm.expired:
                freed_vllm.setdefault(r, i)
            for r in got_model.released | got_model.expired:
                freed_model.setdefault(r, i)
            differing += got_model != got_vllm
        for r in dup_ids:
            assert freed_vllm[r] <= freed_model[r], f"vLLM freed {r} later than the model (seed {seed})"
    assert differing > 0  # the duplicates did make vLLM free early somewhere


def test_deadline_instant_is_expired_and_rebase_cancels_the_scheduler_epoch(pair):
    p = pair(12)
    vl, mo, _ = p.step(100.0, grant=("a",))
    assert vl.live == mo.live == {"a": 112.0}  # scheduler stamped 4196 + 12, rebased onto 100
    vl, mo, _ = p.step(111.75)
    assert vl.live == mo.live == {"a": 112.0} and not vl.expired
    vl, mo, _ = p.step(112.0)  # now == deadline: expired (vLLM now >= expires; model deadline <= now)
    assert vl.expired == mo.expired == {"a"} and vl.live == mo.live == {}


def test_heartbeat_never_shortens_and_extends_from_now(pair):
    p = pair(30)  # E = 20
    vl, mo, _ = p.step(100.0, grant=("a",))
    assert vl.live == mo.live == {"a": 130.0}
    vl, mo, _ = p.step(101.0, notifs={"D0": [b"HB:a"]})  # 121 < 130: unchanged
    assert vl.live == mo.live == {"a": 130.0}
    vl, mo, _ = p.step(115.5, notifs={"D0": [b"HB:a,a"], "D1": [b"HB:a"]})
    assert vl.live == mo.live == {"a": 135.5}


# --------------------------------------------------------------------------------------------
# Differences, P side
# --------------------------------------------------------------------------------------------
def test_d1_duplicate_completion_from_one_rank_frees_early_in_vllm(pair):
    p = pair(12)
    p.step(100.0, grant=("a",))
    vl, mo, an = p.step(101.0, notifs={"D0": [b"a:2", b"a:2"]})  # D1 is still reading
    assert vl.released == an.released == {"a"} and vl.live == {}  # vLLM: freed under D1's read
    assert mo.released == frozenset() and mo.live == {"a": 112.0} and mo.counted == {"a": 1}
    assert p.table.counters["duplicate_completions"] == 1
    vl, mo, _ = p.step(102.0, notifs={"D1": [b"a:2"]})  # D1 finishes reading
    assert mo.released == {"a"} and vl.released == frozenset()
    assert p.vllm.counters()["notifications_after_expiry"] == 1  # "Potentially invalid KV blocks"


def test_d2_completion_for_an_unknown_id_is_dropped_by_vllm_buffered_by_leasekit(pair):
    p = pair(12)
    vl, mo, _ = p.step(100.0, notifs={"D0": [b"x:1"]})
    assert p.vllm.counters()["notifications_after_expiry"] == 1  # dropped, logged
    assert p.table.counters["buffered_completions"] == 1 and vl.released == mo.released == frozenset()
    vl, mo, _ = p.step(101.0, grant=("x",))
    assert mo.released == {"x"} and mo.live == {}  # matched at the grant
    assert vl.released == frozenset() and vl.live == {"x": 113.0}  # vLLM pins it for the full L
    vl, mo, _ = p.step(113.0)
    assert vl.expired == {"x"} and mo.expired == frozenset()
    assert p.vllm.counters()["expired"] == 1 and p.table.counters["expired"] == 0


def test_d3_completion_between_scheduling_and_grant(pair):
    p = pair(12)
    p.step(100.0, register=("x", "y"))
    vl, mo, _ = p.step(100.5, notifs={"D0": [b"x:1", b"y:2"]})
    assert vl.released == {"x"} and mo.released == frozenset()  # vLLM frees x before its grant
    assert p.table.counters["buffered_completions"] == 2
    vl, mo, _ = p.step(101.0, finish=("x", "y"))
    assert vl.released == frozenset() and mo.released == {"x"}  # leasekit frees x at the grant
    assert "x" not in vl.live and "x" not in mo.live  # vLLM dropped x's grant (not in _reqs_to_process)
    assert vl.live == mo.live == {"y": 113.0} and vl.counted == mo.counted == {"y": 1}
    vl, mo, _ = p.step(102.0, notifs={"D1": [b"y:2"]})
    assert vl.released == mo.released == {"y"} and vl.live == mo.live == {}


@pytest.mark.parametrize(("msg", "vllm_raises", "reason"), [
    (b"\xff\xfe", UnicodeDecodeError, REASON_NOT_UTF8),
    (b"garbage", ValueError, REASON_NO_COLON),  # not enough values to unpack
    (b"", ValueError, REASON_EMPTY),
    (b"a:x", ValueError, REASON_BAD_COUNT),  # int('x') on a live id
    (b"s:1.0", ValueError, REASON_BAD_COUNT),  # s is scheduled, not granted: still int()
])
def test_d4_malformed_notification_raises_out_of_vllm(pair, msg, vllm_raises, reason):
    p = pair(12)  # E = 8
    p.step(100.0, grant=("a", "b"), register=("s",))
    p.clock.now = 105.0
    p.worker.nixl_wrapper.deliver({"D0": [b"HB:a", msg, b"b:1"]})
    with p.vllm.clocks(), pytest.raises(vllm_raises):
        p.worker._get_new_notifs()
    assert p.worker._reqs_to_send == {"a": 113.0, "b": 112.0}  # the heartbeat before it applied
    assert p.worker.nixl_wrapper.inbox == {}  # "b:1" was drained and lost: b stays pinned
    decoded = decode_notification(msg)
    assert isinstance(decoded, DecodeError) and decoded.reason == reason
    res = p.table.step(105.0, [("D0", decode_notification(m)) for m in (b"HB:a", msg, b"b:1")])
    assert [e.req_id for e in res.ended] == ["b"] and res.errors == [decoded]
    assert p.table.get("a").deadline_s == 113.0


def test_d4_bad_count_for_an_unknown_id_does_not_raise_in_vllm(pair):
    p = pair(12)
    vl, _, _ = p.step(100.0, notifs={"D0": [b"ghost:x"]})  # dropped before int()
    assert p.vllm.counters()["notifications_after_expiry"] == 1
    assert p.model.errors[0].reason == REASON_BAD_COUNT


@pytest.mark.parametrize(("count", "vllm_frees"), [("+1", True), (" 1", True), ("1 ", True),
                                                     ("0", False), ("-1", False)])
def test_d5_counts_int_accepts(pair, count, vllm_frees):
    p = pair(12)
    p.step(100.0, grant=("a",))
    vl, mo, _ = p.step(101.0, notifs={"D0": [f"a:{count}".encode()]})
    assert mo.live == {"a": 112.0} and p.model.errors[0].reason == REASON_BAD_COUNT
    if vllm_frees:
        assert vl.released == {"a"}
    else:  # counted against 0 / -1: can never be equal
        assert vl.live == {"a": 112.0} and p.worker.consumer_notification_counts_by_req["a"] == 1
        vl, mo, _ = p.step(102.0, notifs={"D1": [b"a:1"]})
        assert mo.released == {"a"} and vl.released == frozenset()  # vLLM: count 2 != 1
        vl, _, _ = p.step(112.0)
        assert vl.expired == {"a"}


def test_d6_disagreeing_counts_pin_until_expiry_in_vllm(pair):
    p = pair(12)
    p.step(100.0, grant=("a",))
    vl, mo, _ = p.step(101.0, notifs={"D0": [b"a:2"]})
    assert vl.counted == mo.counted == {"a": 1}
    vl, mo, _ = p.step(102.0, notifs={"D1": [b"a:1"]})
    assert mo.released == {"a"}
    assert vl.live == {"a": 112.0} and p.worker.expected_consumer_notifications_by_req["a"] == 1
    vl, _, _ = p.step(112.0)
    assert vl.expired == {"a"}


@pytest.mark.parametrize(("msg", "vllm_extends", "reason"), [
    (b"HB:a,,b", {"a", "b"}, REASON_EMPTY_ID),
    (b"HB:", set(), REASON_EMPTY_ID),
    (b"HB:a,\x01", {"a"}, REASON_BAD_ID),
    (b"HB:a," + b"z" * 1025, {"a"}, REASON_BAD_ID),
])
def test_d7_heartbeat_with_a_bad_id(pair, msg, vllm_extends, reason):
    p = pair(12)  # E = 8
    p.step(100.0, grant=("a", "b"))
    vl, mo, _ = p.step(105.0, notifs={"D0": [msg]})
    assert vl.live == {r: (113.0 if r in vllm_extends else 112.0) for r in ("a", "b")}
    assert mo.live == {"a": 112.0, "b": 112.0}  # the whole heartbeat refused
    assert p.model.errors[0].reason == reason


def test_d9_regrant_of_a_live_id(pair):
    p = pair(12)
    p.step(100.0, grant=("a",))
    vl, mo, _ = p.step(106.0, grant=("a",))
    assert vl.live == {"a": 118.0} and mo.live == {"a": 112.0}


def test_decoder_agrees_with_vllm_parsing_on_well_formed_messages(pair):
    """Well-formed messages (ids with ':' and non-ASCII, heartbeats with repeats) mean the same."""
    p = pair(12)
    ids = ("chat:1", "r2-é", "cmpl-3-0")
    p.step(100.0, grant=ids)
    vl, mo, _ = p.step(104.0, notifs={"D0": [b"HB:chat:1,chat:1,r2-\xc3\xa9,nope"],
                                      "D1": [b"chat:1:2", "r2-é:1".encode()]})
    assert vl == mo and vl.live == {"chat:1": 112.0, "cmpl-3-0": 112.0} and vl.released == {"r2-é"}
    assert decode_notification(b"chat:1:2") == Completion("chat:1", 2)
