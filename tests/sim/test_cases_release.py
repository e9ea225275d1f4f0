"""Incident classes K04-K07 in virtual time, over families of timings: each lease freed exactly once, and promptly."""

import itertools
import math

import pytest

from leasekit.lease import LeaseTiming
from leasekit.lease.table import LeaseEnd, Outcome, PLeaseTable
from leasekit.sim import RequestSpec, World, WorldConfig
from leasekit.sim.blocks import BlockPool
from tests.sim.cases_helpers import assert_invariants


# -- K04 races between finish, abort, expiry and notifications -----------------------------------
OPS = ("abort", "expire", "done", "duplicate_done")


@pytest.mark.parametrize("order", list(itertools.permutations(OPS)))
@pytest.mark.parametrize("consumers", [1, 2])
def test_k04_every_ordering_frees_exactly_once(order, consumers):
    timing = LeaseTiming.from_lease_duration(30)
    table, pool = PLeaseTable(timing), BlockPool(64)
    refs = pool.allocate("R", 8)
    frees = 0

    def free(result):
        nonlocal frees
        end = result.end if hasattr(result, "end") else result
        if isinstance(end, LeaseEnd):
            frees += 1
            pool.free("R", refs)
        elif isinstance(result, list):
            for e in result:
                frees += 1
                pool.free(e.req_id, refs)

    free(table.grant("R", 0.0, kv_blocks=8))
    now = 0.0
    for op in order:
        now += 1.0
        if op == "abort":
            free(table.abort("R", now))
        elif op == "expire":
            now = max(now, 30.0)
            free(table.reap(now))
        elif op == "done":
            for rank in range(consumers):
                free(table.completion("R", consumers, now, sender=f"D-r{rank}"))
        else:
            free(table.completion("R", consumers, now, sender="D-r0"))
    assert frees == 1
    assert pool.pinned == 0 and pool.violations["double_free"] == 0
    assert len(table) == 0


# -- K05 reaper completeness ---------------------------------------------------------------------
@pytest.mark.parametrize("b_offset, hb_every", [(1.0, 5.0), (0.5, 1.0), (7.0, 2.5)])
def test_k05_a_lease_behind_a_live_head_is_still_reaped(b_offset, hb_every):
    table = PLeaseTable(LeaseTiming.from_lease_duration(30))
    table.grant("A", 0.0)
    table.grant("B", b_offset)
    reaped_b_at = None
    t = 0.0
    while t <= 300:
        t = round(t + 0.1, 9)
        if abs(t / hb_every - round(t / hb_every)) < 1e-9:
            table.heartbeat(["A"], t)
        for end in table.reap(t):
            if end.req_id == "B":
                reaped_b_at = t
        assert all(lease.deadline_s > t for lease in table.leases())
    assert reaped_b_at == pytest.approx(math.ceil((b_offset + 30) * 10 - 1e-6) / 10)
    assert "A" in table


# -- K06 completion before registration; n > 1 siblings ------------------------------------------
@pytest.mark.parametrize("early, grant", [(0.100, 0.150), (0.0, 5.0), (1.0, 1.0)])
def test_k06_completion_before_grant_is_buffered_and_matched(early, grant):
    table = PLeaseTable(LeaseTiming.from_lease_duration(30))
    assert table.completion("R", 1, early, sender="D-r0").kind == "buffered"
    result = table.grant("R", grant)
    assert isinstance(result, LeaseEnd) and result.outcome is Outcome.RELEASED and result.at_s == grant
    assert len(table) == 0


@pytest.mark.parametrize("rate_per_s, n", [(10, 4), (5, 8)])
def test_k06_parallel_sampling_siblings_end_promptly_and_pins_stay_bounded(rate_per_s, n):
    w = World(WorldConfig(latency_s=0.002))
    peak = 0
    requests = 0
    for i in range(rate_per_s * 60):
        t = i / rate_per_s
        for s in range(n):
            w.add(RequestSpec(f"R{i}.{s}", prefill_end_s=t, blocks=4, route_delay_s=0.01, prefix_hit=s > 0))
            requests += 1
    for step in range(0, 6100):
        w.run(step * 0.01)
        peak = max(peak, w.pinned_blocks()[0])
    assert all(l.outcome is Outcome.RELEASED for l in w.leases.values()) and len(w.leases) == requests
    assert max(l.end_true - l.granted_true for l in w.leases.values()) < 0.5
    assert peak <= 4 * n * rate_per_s  # at most ~1 s worth of requests pinned
    assert_invariants(w)


# -- K07 heterogeneous tensor parallelism --------------------------------------------------------
@pytest.mark.parametrize("p_tp, d_tp", [(4, 2), (8, 2), (2, 1), (4, 4)])
def test_k07_every_p_rank_frees_in_the_same_step(p_tp, d_tp):
    w = World(WorldConfig(p_tp=p_tp, d_tp=d_tp, latency_s=0.001, max_running=1))
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.01, d_local_id="d-local-R"))
    w.add(RequestSpec("Q", prefill_end_s=0.0, route_delay_s=0.02, d_local_id="d-local-Q"))
    w.run(60)
    for req in ("R", "Q"):
        ends = {w.lease(req, rank).end_local for rank in range(p_tp)}
        assert len(ends) == 1 and all(w.lease(req, r).outcome is Outcome.RELEASED for r in range(p_tp))
    assert w.pinned_blocks() == [0] * p_tp
    assert_invariants(w)


@pytest.mark.parametrize("L, kill", [(30, 5.0), (12, 2.0)])
def test_k07_p_waits_for_two_completions_and_one_is_lost(L, kill):
    # D TP=4 on P TP=2: each P rank waits for 2 completions; D rank 1's never arrives
    w = World(WorldConfig(lease_duration_s=L, p_tp=2, d_tp=4, latency_s=0.001))
    w.bus.rules.append(lambda msg, rng: __import__("leasekit.sim.bus", fromlist=["Action"]).Action(drop=True)
                       if msg.kind == "completion" and msg.src.endswith("-r1") else None)
    w.add(RequestSpec("R", prefill_end_s=0.0, route_delay_s=0.5))
    w.kill_d(kill)
    w.run(3 * L)
    assert w.lease("R", 1).outcome is Outcome.RELEASED  # ranks 2 and 3 reported
    lost = w.lease("R", 0)
    assert lost.outcome is Outcome.EXPIRED  # bounded: never a wait forever
    assert lost.end_local <= max(L, max(lost.hb_processed_local, default=0) + LeaseTiming.from_lease_duration(L).extension_s) + 0.1 + 1e-9
    assert_invariants(w)
