"""LeaseKit's production P worker against vLLM's own, step by step, on the same scripts.

``LeaseKitPullWorker`` replaces vLLM 0.32.0's full-scan reaper (``nixl/base_worker.py:
_reap_expired_send_leases``) with an expiry heap (:class:`leasekit.lease.table.PLeaseTable`) and handles
D's notifications itself (:mod:`leasekit.vllm.prefill.notifications`). On scripts where the two are meant to agree (one
D agent, each lease completed at most once with ``n = 1``; binding and duplicate handling are where
LeaseKit differs on purpose, see ``test_differential_vllm_p.py``), both workers, built the way
``tests/vllm_replay.py`` builds vLLM's (real ``start_load_kv``, ``_get_new_notifs`` and
``_reap_expired_send_leases`` of each class, a manual clock), must show the same live leases with the same
deadlines, release the same ids and reap the same ids at every step: drain before reap, never shorter, an
expired lease reported exactly once, the deadline instant expired.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from leasekit.cluster.model import write_tiny_llama
from tests import vllm_replay as R

EPOCH = 4096.0
DURATIONS = (6, 30, 7.5)
SEEDS = 15


@pytest.fixture(scope="module")
def v(vllm_available):
    return R.load_vllm()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def leasekit_worker(v, vllm_config, lease_duration, run_dir):
    """``LeaseKitPullWorker`` without vLLM's ``__init__`` (no NIXL agent): vLLM's attributes as
    :func:`tests.vllm_replay.make_worker` sets them, then LeaseKit's own part (``_lk_setup``)."""
    from leasekit.vllm.connector import LeaseKitPullWorker

    stock = R.make_worker(v, lease_duration)
    worker = object.__new__(LeaseKitPullWorker)
    worker.__dict__.update(stock.__dict__)
    worker.kv_transfer_config = vllm_config.kv_transfer_config
    worker.kv_transfer_config.kv_connector_extra_config["leasekit_run_dir"] = str(run_dir)
    worker._lk_setup(R.P_ENGINE)
    return worker


class LeaseKitP(R.VllmP):
    """:class:`tests.vllm_replay.VllmP` with LeaseKit's worker; LeaseKit's modules read the same clock."""

    def __init__(self, v, config, lease_duration, clock, run_dir):
        super().__init__(v, config, lease_duration, clock, scheduler_epoch_offset=EPOCH)
        self.worker = leasekit_worker(v, config, lease_duration, run_dir)

    @contextlib.contextmanager
    def clocks(self):
        import leasekit.vllm.worker as connector  # the worker mixin reads the clock
        import leasekit.vllm.prefill.hooks as phooks  # P's components read no clock: the hooks pass ``now``

        saved = [(m, m.time) for m in (connector, phooks)]
        try:
            for module, real in saved:
                module.time = R._TimeProxy(real, self.clock)
            with super().clocks():
                yield
        finally:
            for module, real in saved:
                module.time = real


def one_agent(script):
    """The script with every message from one D agent, every completion ``n = 1`` and sent once."""
    completed: set[str] = set()
    out = []
    for step in script:
        msgs = []
        for batch in step.notifs.values():
            for raw in batch:
                text = raw.decode()
                if text.startswith("HB:"):
                    msgs.append(raw)
                else:
                    req_id = text.rsplit(":", 1)[0]
                    if req_id not in completed:
                        completed.add(req_id)
                        msgs.append(f"{req_id}:1".encode())
        out.append(R.PStep(step.t, grant=step.grant, register=step.register, finish=step.finish,
                           notifs={"D0": msgs} if msgs else {}))
    return out


@pytest.mark.parametrize("L", DURATIONS, ids=lambda L: f"L={L!r}")
def test_leasekit_worker_reaps_and_extends_as_vllm_does(v, model_dir, tmp_path, L):
    config = R.make_vllm_config(v, model_dir, L, "kv_producer")
    seen = {"released": 0, "expired": 0, "on_the_instant": 0, "extended": 0}
    for seed in range(SEEDS):
        script = one_agent(R.random_p_script(random.Random(f"w-{L!r}-{seed}"), L))
        stock = R.VllmP(v, config, L, R.ManualClock(), scheduler_epoch_offset=EPOCH)
        lk = LeaseKitP(v, config, L, R.ManualClock(), tmp_path / f"{seed}")
        before: dict = {}
        for i, step in enumerate(script):
            want, got = stock.step(step), lk.step(step)
            where = f"L={L!r} seed={seed} step={i} t={step.t} {step}"
            assert got.live == want.live, f"live leases / deadlines differ at {where}"
            assert got.released == want.released, f"released sets differ at {where}"
            assert got.expired == want.expired, f"reaped sets differ at {where}"
            assert len(lk.worker._lk_p.leases) == len(lk.worker._reqs_to_send), where  # the heap indexes them all
            seen["released"] += len(want.released)
            seen["expired"] += len(want.expired)
            seen["on_the_instant"] += sum(before.get(r) == step.t for r in want.expired)
            seen["extended"] += sum(r in before and d > before[r] for r, d in want.live.items())
            before = want.live
        assert lk.worker._reqs_to_send == {} and len(lk.worker._lk_p.leases) == 0
        assert stock.counters()["expired"] == len(lk.worker.xfer_stats.data["num_kv_expired_reqs"])
    assert all(n >= 5 for n in seen.values()), seen


def test_a_lease_added_behind_the_heaps_back_is_still_reaped(v, model_dir, tmp_path):
    """A lease vLLM adds to ``_reqs_to_send`` by a path LeaseKit does not hook is indexed by the next
    reap (sizes differ) and expires on time; one whose deadline vLLM moved is reaped at the new one."""
    config = R.make_vllm_config(v, model_dir, 6, "kv_producer")
    clock = R.ManualClock(100.0)
    lk = LeaseKitP(v, config, 6, clock, tmp_path)
    lk.step(R.PStep(100.0, grant=("A",)))
    w = lk.worker
    w._reqs_to_process.add("X")
    w._reqs_to_send["X"] = 103.0  # behind the heap's back
    w._reqs_to_send["A"] = 104.0  # moved shorter behind its back (A's heap entry says 106)
    assert lk.step(R.PStep(102.75)).expired == frozenset()
    assert lk.step(R.PStep(103.0)).expired == frozenset({"X"})
    assert lk.step(R.PStep(104.0)).expired == frozenset({"A"})
    assert w._reqs_to_send == {} and len(w._lk_p.leases) == 0


@pytest.mark.parametrize("seed", range(6))
def test_multi_agent_scripts_keep_the_heap_equal_to_vllms_lease_map(v, model_dir, tmp_path, seed):
    """Random scripts with 1-4 D agents and duplicate senders (where LeaseKit's binding differs from
    stock on purpose): whatever LeaseKit decides, its heap indexes exactly ``_reqs_to_send`` (ids and
    deadlines) after every step, and no lease stays past its deadline."""
    config = R.make_vllm_config(v, model_dir, 6, "kv_producer")
    script = R.random_p_script(random.Random(f"multi-{seed}"), 6, duplicate_senders=bool(seed % 2))
    lk = LeaseKitP(v, config, 6, R.ManualClock(), tmp_path / f"{seed}")
    for i, step in enumerate(script):
        lk.step(step)
        w, where = lk.worker, f"seed={seed} step={i} t={step.t}"
        assert {r: w._lk_p.leases.get(r).deadline_s for r in w._reqs_to_send} == w._reqs_to_send, where
        assert len(w._lk_p.leases) == len(w._reqs_to_send), where
        assert all(d > step.t for d in w._reqs_to_send.values()), where
    assert lk.worker._reqs_to_send == {}


def test_a_telemetry_failure_on_one_lease_spares_the_others(v, model_dir, tmp_path):
    """An exception in the span recorder for one lease (a bug, a broken observer) neither keeps the next
    ids of the same heartbeat from renewal nor turns the other leases' expiries into aborts."""
    config = R.make_vllm_config(v, model_dir, 6, "kv_producer")
    lk = LeaseKitP(v, config, 6, R.ManualClock(100.0), tmp_path)
    lk.step(R.PStep(100.0, grant=("A", "B")))
    w = lk.worker
    real_extend, real_expire, expired = w._lk.extend, w._lk.expire, []

    def extend(req_id, *a, **k):
        if req_id == "A":
            raise RuntimeError("observer bug")
        return real_extend(req_id, *a, **k)

    def expire(req_id, **k):
        expired.append(req_id)
        if len(expired) == 1:
            raise RuntimeError("observer bug")
        return real_expire(req_id, **k)

    w._lk.extend, w._lk.expire = extend, expire
    lk.step(R.PStep(104.0, notifs={"D0": [b"HB:A,B"]}))
    assert w._reqs_to_send == {"A": 108.0, "B": 108.0}  # stock: max(106, 104 + 4) for both
    assert lk.step(R.PStep(108.0)).expired == frozenset({"A", "B"}) and len(expired) == 2


def test_a_rebound_lease_map_is_indexed_again(v, model_dir, tmp_path):
    """Should vLLM ever replace its ``_reqs_to_send`` dict object, the heap follows the new one: old and
    new leases are reaped on time, nothing raises into the engine loop."""
    config = R.make_vllm_config(v, model_dir, 6, "kv_producer")
    lk = LeaseKitP(v, config, 6, R.ManualClock(100.0), tmp_path)
    lk.step(R.PStep(100.0, grant=("A",)))
    w = lk.worker
    w._reqs_to_send = dict(w._reqs_to_send)
    lk.step(R.PStep(101.0, grant=("B",)))
    assert lk.step(R.PStep(106.0)).expired == frozenset({"A"})
    assert lk.step(R.PStep(107.0)).expired == frozenset({"B"}) and w._reqs_to_send == {}


def test_a_worker_built_without_init_behaves_as_vllms(v, model_dir, tmp_path):
    """vLLM's own unit tests build workers with ``object.__new__`` and a few attributes; LeaseKit's worker
    built so (its setup never ran) must then be vLLM's worker exactly, not crash on its missing state."""
    from leasekit.vllm.connector import LeaseKitPullWorker

    config = R.make_vllm_config(v, model_dir, 6, "kv_producer")
    script = one_agent(R.random_p_script(random.Random("bare"), 6))
    stock = R.VllmP(v, config, 6, R.ManualClock(), scheduler_epoch_offset=EPOCH)
    bare = R.VllmP(v, config, 6, R.ManualClock(), scheduler_epoch_offset=EPOCH)
    worker = object.__new__(LeaseKitPullWorker)
    worker.__dict__.update(bare.worker.__dict__)
    bare.worker = worker
    assert worker._lk_ready is False
    for step in script:
        want, got = stock.step(step), bare.step(step)
        assert (got.live, got.released, got.expired) == (want.live, want.released, want.expired), step
