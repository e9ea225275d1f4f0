"""D fails closed on the real pair (issue 6 points 1-3; docs/fail-closed.md): blocks P reclaimed and
reused by other requests before D's read are never served.

Request A waits in D's queue; D is frozen (cgroup freezer) for longer than the extension E, so P expires
A's lease and frees its KV blocks; P's small KV cache (40 blocks of 128 tokens) is then cycled by other
prefills, so A's blocks hold another prompt's KV; D thaws and serves A. The reference is a fresh routed
run of the same prompt (greedy, deterministic).

The tiny model's dummy weights make its tokens nearly blind to the KV context, so the proof that the
blocks were reused is made on the KV itself: with fault points on, P records a digest of A's blocks at
grant and D a digest of the blocks it read (:mod:`leasekit.vllm.kvdigest`). A verified read's digests
are equal; the late read's differ.

- LeaseKit P + LeaseKit D: D read another request's KV (digests differ), its read gate discarded the
  read (P's verdict ``reaped``, or no verdict in time), vLLM recomputed (``kv_load_failure_policy=
  recompute``), and A's tokens equal the reference.
- Slow first contact: D meets P for the first time (its first handshake) only after A's lease expired
  (a router or queue slower than L in front of D; vLLM's 5 s handshake receive timeout, ``base_worker.py``
  ``_nixl_handshake``, makes a single handshake slower than L = 6 s fail instead). D's read is discarded
  and recomputed.
- LeaseKit P + stock D (the hazard, and compatibility): nothing breaks, and D answers HTTP 200 for A
  although P saw its read complete after the lease had ended (P's ``kv_lease_late_read`` span), from
  the blocks the same procedure is shown above to reuse: only the gate stands between them and the user.
"""

import threading
import time

import httpx
import pytest

from leasekit.chaos.faults.stall import FreezerStall
from leasekit.cluster.pair import PairSpec
from leasekit.cluster.serverspec import SERVED_MODEL_NAME
from leasekit.lease.readgate import OUTCOME_REAPED, OUTCOME_TIMEOUT, OUTCOME_VERIFIED, PROOF_ACK, PROOF_PLEDGE
from leasekit.telemetry import semconv as sc
from leasekit.telemetry import metrics as m
from leasekit.telemetry.spanfile import read_span_dir
from leasekit.vllm.kvdigest import KV_DIGEST_ATTR
from tests.integration.test_hostile_peer import lease
from tests.prefetch import PREFETCH
from tests.scrape import labelled

pytestmark = pytest.mark.pair
L, E = 6, 4
TOKENS = 8
PLEDGE_TRIES = 4
KV_CACHE_BYTES = 5 << 20  # 5120 tokens: 40 blocks of 128 tokens on this model (one is vLLM's null block)


def _gauge(server, name: str) -> float:
    return server.metrics().get(name) or 0.0


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _cycle_p_kv_cache(pair, requests: int = 8, tokens: int = 1000) -> None:
    """Plain completions on P (no lease) that together allocate every block of P's KV cache."""
    for _ in range(requests):
        response = httpx.post(f"{pair.prefill.url}/v1/completions", timeout=120, json={
            "model": SERVED_MODEL_NAME, "prompt": pair.prompt(tokens), "max_tokens": 1})
        assert response.status_code == 200, response.text[:300]


def _read_after_reuse(pair):
    """Run the scenario of the module docstring; returns (A's P request id, served tokens, reference)."""
    router = pair.router
    prompt = pair.prompt(48)
    stop = threading.Event()
    threading.Thread(target=router.hold_decode_slot, args=(pair.prompt(16), stop), daemon=True).start()
    _wait(lambda: _gauge(pair.decode, "vllm:num_requests_running") >= 1, 60, "D to run the slot holder")
    prefill = router.prefill(prompt)
    assert prefill.ok, prefill
    served = {}
    decode = threading.Thread(target=lambda: served.update(
        result=router.decode(prompt, prefill.kv_transfer_params, TOKENS, traceparent=prefill.traceparent)))
    decode.start()
    _wait(lambda: _gauge(pair.decode, "vllm:num_requests_waiting") >= 1, 60, "A to wait in D's queue")
    freeze = FreezerStall(pair.decode.pids)
    freeze.inject()
    try:
        time.sleep(E + 2.0)  # no heartbeat arrives: P expires A's lease at last heartbeat + E
        _cycle_p_kv_cache(pair)
    finally:
        freeze.cleanup()
    stop.set()
    decode.join(180)
    result = served.get("result")
    assert result is not None and result.ok, result
    reference = router.generate(prompt, TOKENS).decode
    assert reference is not None and reference.ok, reference
    return prefill.request_id, result.token_ids, reference.token_ids


def _read_outcomes(pair, rid: str) -> list[str]:
    return [s.attributes.get(sc.READ_OUTCOME) for s in read_span_dir(pair.span_dir).spans
            if s.name == sc.READ_SPAN_NAME and s.attributes.get(sc.REQUEST_ID) == rid]


def _read_waits(pair, rid: str) -> list[tuple[str, float]]:
    return [(s.attributes.get(sc.READ_OUTCOME), s.attributes.get(sc.READ_VERDICT_WAIT_S))
            for s in read_span_dir(pair.span_dir).spans
            if s.name == sc.READ_SPAN_NAME and s.attributes.get(sc.REQUEST_ID) == rid]


def _read_proofs(pair, rid: str) -> list[tuple[str, float, str | None]]:
    return [(s.attributes.get(sc.READ_OUTCOME), s.attributes.get(sc.READ_VERDICT_WAIT_S), s.attributes.get(sc.READ_PROOF))
            for s in read_span_dir(pair.span_dir).spans
            if s.name == sc.READ_SPAN_NAME and s.attributes.get(sc.REQUEST_ID) == rid]


def _lease_attribute(pair, rid: str, key: str):
    for span in read_span_dir(pair.span_dir).spans:
        if span.name == sc.LEASE_SPAN_NAME and span.attributes.get(sc.REQUEST_ID) == rid:
            return span.attributes.get(key)
    return None


def _queued_read(pair, wait_s: float = 3.0) -> str:
    """One request that waits ``wait_s`` s in D's queue (D heartbeats it) before D reads; its P id."""
    stop = threading.Event()
    threading.Thread(target=pair.router.hold_decode_slot, args=(pair.prompt(16), stop), daemon=True).start()
    _wait(lambda: _gauge(pair.decode, "vllm:num_requests_running") >= 1, 60, "D to run the slot holder")
    prompt = pair.prompt(48)
    prefill = pair.router.prefill(prompt)
    served = {}
    thread = threading.Thread(target=lambda: served.update(result=pair.router.decode(prompt, prefill.kv_transfer_params, TOKENS)))
    thread.start()
    time.sleep(wait_s)
    stop.set()
    thread.join(120)
    assert served.get("result") is not None and served["result"].ok, served
    return prefill.request_id


def _digests(pair, rid: str) -> tuple[str | None, str | None]:
    """(P's digest of the lease's blocks at grant, D's digest of the blocks it read)."""
    p = d = None
    for span in read_span_dir(pair.span_dir).spans:
        if span.attributes.get(sc.REQUEST_ID) == rid:
            if span.name == sc.LEASE_SPAN_NAME:
                p = span.attributes.get(KV_DIGEST_ATTR)
            elif span.name == sc.READ_SPAN_NAME:
                d = span.attributes.get(KV_DIGEST_ATTR)
    return p, d


LATE_READ_PAIR = PairSpec.pinned(lease_duration_s=L, prefill_kv_cache_bytes=KV_CACHE_BYTES, warm_up=False, fault_files=True,
                                fail_closed=True)
STOCK_D_PAIR = PairSpec.pinned(lease_duration_s=L, decode_connector="stock", prefill_kv_cache_bytes=KV_CACHE_BYTES,
                               fail_closed=True)
PREFETCH_PAIRS = [LATE_READ_PAIR, STOCK_D_PAIR]
"""Started ahead in the background (tests/prefetch.py)."""


def test_blocks_reused_before_a_late_read_are_never_served(vllm_available, tmp_path):
    with PREFETCH.pair_for(LATE_READ_PAIR, tmp_path / "run") as pair:
        # first contact after the lease expired: D's first handshake and read come too late
        prompt = pair.prompt(48)
        late = pair.router.prefill(prompt)
        time.sleep(L + 1.0)
        served = pair.router.decode(prompt, late.kv_transfer_params, TOKENS)
        assert served.ok, served
        assert lease(pair, late.request_id).outcome == "expired"
        _wait(lambda: _read_outcomes(pair, late.request_id) != [], 10, "D's read span")
        assert _read_outcomes(pair, late.request_id)[0] in (OUTCOME_REAPED, OUTCOME_TIMEOUT)
        assert served.token_ids == pair.router.generate(prompt, TOKENS).decode.token_ids
        # the normal path: one verified read, no discard
        ok = pair.router.generate(pair.prompt(48), TOKENS)
        assert ok.decode is not None and ok.decode.ok
        _wait(lambda: _read_outcomes(pair, ok.prefill.request_id) == [OUTCOME_VERIFIED], 10, "a verified read span")
        lease(pair, ok.prefill.request_id)
        p_digest, d_digest = _digests(pair, ok.prefill.request_id)
        assert p_digest and p_digest == d_digest, "a verified read holds P's KV"
        # a read D heartbeated in its queue: P's acknowledgements prove the lease, no wait (fast path)
        queued = _queued_read(pair)
        _wait(lambda: _read_waits(pair, queued) != [], 10, "the queued read's span")
        assert _read_waits(pair, queued) == [(OUTCOME_VERIFIED, 0.0)]
        # a read right after its grant, D holding a fresh sample of P's clock (the previous request's ack):
        # the grant's pledge proves it with no wait, and P kept the blocks pinned until the pledge ended
        # (on a slow host D may finish the read after the pledge ended, P's ack of a queued heartbeat then
        # proves it: also verified with no wait, so such a read is tried again, up to PLEDGE_TRIES times)
        assert pair.router.generate(pair.prompt(48), TOKENS).decode.ok
        seen = []
        for _ in range(PLEDGE_TRIES):
            fast = pair.router.generate(pair.prompt(48), TOKENS)
            assert fast.decode is not None and fast.decode.ok
            _wait(lambda: _read_proofs(pair, fast.prefill.request_id) != [], 10, "the immediate read's span")
            seen.append(_read_proofs(pair, fast.prefill.request_id))
            assert seen[-1] in ([(OUTCOME_VERIFIED, 0.0, PROOF_PLEDGE)], [(OUTCOME_VERIFIED, 0.0, PROOF_ACK)]), seen
            if seen[-1][0][2] == PROOF_PLEDGE:
                break
        assert seen[-1] == [(OUTCOME_VERIFIED, 0.0, PROOF_PLEDGE)], f"no read of {PLEDGE_TRIES} was proven by its pledge: {seen}"
        assert lease(pair, fast.prefill.request_id).outcome == "released"
        assert 0 < _lease_attribute(pair, fast.prefill.request_id, sc.PLEDGE_HOLD_S) <= 1.0 + 0.5
        p_digest, d_digest = _digests(pair, fast.prefill.request_id)
        assert p_digest and p_digest == d_digest, "a pledged read holds P's KV"
        rid, tokens, reference = _read_after_reuse(pair)
        assert lease(pair, rid).outcome == "expired"
        # spans are exported in batches (every 0.2 s): P's lease span being there says nothing of D's
        _wait(lambda: _read_outcomes(pair, rid) != [], 10, "D's read span of the late read")
        outcomes = _read_outcomes(pair, rid)
        assert len(outcomes) == 1 and outcomes[0] in (OUTCOME_REAPED, OUTCOME_TIMEOUT), outcomes
        p_digest, d_digest = _digests(pair, rid)
        assert p_digest and d_digest and p_digest != d_digest, "D read blocks P had reused for other requests"
        assert tokens == reference, "the discarded read must be recomputed into the reference tokens"
        reads = labelled(pair.decode.url, m.READS.sample_names[0], "outcome")
        assert reads[OUTCOME_VERIFIED] >= 6 and reads[OUTCOME_REAPED] + reads[OUTCOME_TIMEOUT] == 2, reads
        proofs = labelled(pair.decode.url, m.READ_PROOFS_METRIC.sample_names[0], "proof")
        assert proofs[PROOF_PLEDGE] >= 1 and sum(proofs.values()) == reads[OUTCOME_VERIFIED], (proofs, reads)
        held = pair.prefill.metrics().get(m.PLEDGE_HOLD.name + "_count") or 0
        assert held >= 1, "P observed the pledge hold"


def test_stock_d_serves_a_read_of_reclaimed_and_reused_blocks(vllm_available, tmp_path):
    with PREFETCH.pair_for(STOCK_D_PAIR, tmp_path / "run") as pair:
        rid, tokens, reference = _read_after_reuse(pair)
        assert lease(pair, rid).outcome == "expired"
        assert _read_outcomes(pair, rid) == []  # a stock D has no read gate: HTTP 200 from reused blocks
        assert len(tokens) == TOKENS and len(reference) == TOKENS
        _wait(lambda: any(s.name == sc.LATE_READ_SPAN_NAME and s.attributes.get(sc.REQUEST_ID) == rid
                          for s in read_span_dir(pair.span_dir).spans),
              15, "LeaseKit P to see the stock D's read complete after the lease had ended")
