"""D side and wire bytes: vLLM 0.32.0's heartbeat batches and bytes equal leasekit's, or differ as D8, F1, F2."""

from __future__ import annotations

import random

import pytest

from leasekit.lease.codec import (
    REASON_EMPTY_ID,
    Completion,
    Heartbeat,
    decode_notification,
    encode_completion,
    encode_heartbeat,
)
from tests import vllm_replay as R
from tests.unit.differential_vllm_helpers import config, v  # noqa: F401 - module-scoped fixtures the tests request

D_DURATIONS = (5, 6, 12, 30, 7.5)
D_SEEDS = 20  # per L: 100 D scripts


# --------------------------------------------------------------------------------------------
# 2. D side
# --------------------------------------------------------------------------------------------
def _check_sent(vd, sent, raw, model_batch, where):
    """Every P rank of each engine got one heartbeat whose bytes are leasekit's encoding."""
    expected = []
    for engine, info in raw.items():
        msg = encode_heartbeat(list(info.req_ids))  # vLLM iterates the same set: same order
        expected += [(agent, msg) for agent in vd.agents(engine).values()]
        decoded = decode_notification(msg)
        assert isinstance(decoded, Heartbeat) and frozenset(decoded.req_ids) == model_batch[engine], where
        assert len(decoded.req_ids) == len(set(decoded.req_ids)), where
    assert sorted(sent) == sorted(expected), where


@pytest.mark.parametrize("L", D_DURATIONS, ids=lambda L: f"L={L!r}")
def test_d_random_scripts_agree_step_by_step(v, config, L):
    seen = {"batches": 0, "throttled": 0, "stops": 0}
    for seed in range(D_SEEDS):
        rng = random.Random(f"d-{L!r}-{seed}")
        script = R.random_d_script(rng, t0=rng.choice([0.0, 0.25, 1.0, 50.0]))
        clock = R.ManualClock()
        vd, md = R.VllmD(v, config(L, "kv_consumer"), L, clock), R.ModelD(L)
        locals_ = set()
        for i, step in enumerate(script):
            where = f"L={L!r} seed={seed} step={i} {step}"
            got_vllm, sent, raw = vd.step(step)
            got_model = md.step(step)
            assert got_model == got_vllm, f"heartbeat batches differ at {where}"
            _check_sent(vd, sent, raw, got_model, where)
            locals_ |= {ev.local for ev in step.events}
            assert set(vd.scheduler._heartbeat_req_engine) == {x for x in locals_ if x in md.tracker}, where
            assert set(vd.scheduler._heartbeat_by_engine) == set(md.tracker.engines()), where
            seen["batches"] += bool(got_vllm)
            seen["throttled"] += bool(not got_vllm and vd.scheduler._heartbeat_by_engine)
            seen["stops"] += sum(ev.kind != "enqueue" for ev in step.events)
    if L // 6 == 0:
        assert seen.pop("throttled") == 0  # H = 0: a batch every step while anything is tracked
    assert all(n >= 5 for n in seen.values()), seen


def _d_pair(v, config, L, t0=0.0):
    clock = R.ManualClock(t0)
    return R.VllmD(v, config(L, "kv_consumer"), L, clock), R.ModelD(L)


def test_d_throttle_timing_on_a_clock_near_zero(v, config):
    vd, md = _d_pair(v, config, 12)  # H = 2, last batch "at" 0.0
    E = R.DEvent
    timeline = [
        (0.25, (E("enqueue", "l1", "P-A", "p1"),), {}),  # 0.25 - 0.0 < 2: no batch yet
        (1.75, (), {}),
        (2.0, (), {"P-A": {"p1"}}),
        (3.75, (E("enqueue", "l2", "P-B", "p2"),), {}),
        (4.0, (E("schedule", "l1"),), {"P-A": {"p1"}, "P-B": {"p2"}}),  # scheduling does not stop it
        (5.0, (E("read_done", "l1"), E("abort", "l2")), {}),
        (9.0, (E("enqueue", "l3", "P-A", "p3"),), {"P-A": {"p3"}}),  # timer idle since 4.0
        (10.0, (E("enqueue", "l4", "P-A", "p3"),), {}),  # l4 shares P's request with l3 (n > 1)
        # stopping l3 drops p3 for l4 too: both keep one set per engine (base_scheduler.py:240-248)
        (11.0, (E("finish", "l1"), E("read_done", "l3")), {}),
    ]
    for t, events, expected in timeline:
        step = R.DStep(t, events)
        got_vllm, _, _ = vd.step(step)
        assert got_vllm == md.step(step) == {e: frozenset(ids) for e, ids in expected.items()}, t
    assert not vd.scheduler._heartbeat_by_engine and md.tracker.engines() == []


@pytest.mark.parametrize("field", ["remote_engine_id", "remote_request_id"])
def test_d8_empty_remote_ids_are_tracked_by_vllm_refused_by_leasekit(v, config, field):
    vd, md = _d_pair(v, config, 12, t0=10.0)
    engine, remote = ("", "p1") if field == "remote_engine_id" else ("P-A", "")
    step = R.DStep(10.0, (R.DEvent("enqueue", "l1", engine, remote),))
    got_vllm, sent, _ = vd.step(step)
    assert got_vllm == {engine: frozenset({remote})} and md.step(step) == {}
    assert {msg for _, msg in sent} == {encode_heartbeat([remote])}
    if remote == "":
        assert sent[0][1] == b"HB:" and decode_notification(b"HB:").reason == REASON_EMPTY_ID


def test_f1_abort_before_schedule_without_remote_host_crashes_build_connector_meta(v, config):
    vd, _ = _d_pair(v, config, 12, t0=10.0)
    vd.step(R.DStep(10.0, (R.DEvent("enqueue", "l1", "P-A", "p1", complete=False),)))
    with pytest.raises(KeyError, match="remote_host"):
        vd.step(R.DStep(11.0, (R.DEvent("abort", "l1"),)))
    # scheduled first, the same request is only warned about and its abort is harmless
    vd, _ = _d_pair(v, config, 12, t0=10.0)
    vd.step(R.DStep(10.0, (R.DEvent("enqueue", "l1", "P-A", "p1", complete=False),)))
    vd.step(R.DStep(11.0, (R.DEvent("schedule", "l1"),)))
    vd.step(R.DStep(12.0, (R.DEvent("abort", "l1"),)))


def test_f2_metadata_aliases_the_scheduler_heartbeat_dict(v, config):
    vd, _ = _d_pair(v, config, 12, t0=10.0)
    _, _, raw = vd.step(R.DStep(10.0, (R.DEvent("enqueue", "l1", "P-A", "p1"),)))
    assert raw is vd.scheduler._heartbeat_by_engine
    vd.scheduler._stop_heartbeat("l1")
    assert raw == {}  # the metadata already built lost its batch


# --------------------------------------------------------------------------------------------
# 3. Notification bytes
# --------------------------------------------------------------------------------------------
def test_heartbeat_bytes_from_send_heartbeats_equal_the_encoder(v, config):
    vd, md = _d_pair(v, config, 30, t0=100.0)
    ids = [f"cmpl-{i}-0" for i in range(5)] + ["chat:7", "r-é"]
    events = tuple(R.DEvent("enqueue", f"l{i}", "P-A", r) for i, r in enumerate(ids))
    batches, sent, raw = vd.step(R.DStep(100.0, events))
    assert batches == md.step(R.DStep(100.0, events)) == {"P-A": frozenset(ids)}
    wire = ("HB:" + ",".join(raw["P-A"].req_ids)).encode()
    assert sent == [("P-A/rank0", wire), ("P-A/rank1", wire)]
    assert wire == encode_heartbeat(raw["P-A"].req_ids) == encode_heartbeat(list(raw["P-A"].req_ids))
    assert set(decode_notification(wire).req_ids) == set(ids)


@pytest.mark.parametrize(("remote_id", "n"), [("cmpl-abc-0", 1), ("chat:7", 2), ("r-é", 4), ("x" * 300, 8)])
def test_completion_bytes_from_read_blocks_equal_the_encoder(v, config, remote_id, n):
    worker = R.make_worker(v, 12)
    worker._remote_agents["P-A"] = {(0, 0): "P-A/rank0", (0, 1): "P-A/rank1"}
    spec = v.tp_mapping.ReadSpec(remote_rank=1, local_block_ids=([],), remote_block_ids=([5, 6],))
    with R.patched_clocks(v, R.ManualClock(1.0), R.ManualClock(1.0)):
        # a full local prefix hit: _read_blocks only notifies P (pull_worker.py:442-468)
        ok = worker._read_blocks(spec, "P-A", "d-req", remote_id, 0, None, 0, n, False)
    assert ok is True
    assert worker.nixl_wrapper.sent == [("P-A/rank1", encode_completion(remote_id, n))]
    assert decode_notification(worker.nixl_wrapper.sent[0][1]) == Completion(remote_id, n)
