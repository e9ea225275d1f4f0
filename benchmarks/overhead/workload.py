"""The workload of the telemetry-overhead benchmark: seeded prompts, the A B B A round order, routed
requests from concurrent clients (warm-ups and measured rounds) and the queue phases in which
requests wait in D's queue for several heartbeat intervals. Times are in seconds."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .pairs import HarnessError, Target
from .stats import TARGETS, RunStats


def round_order(rounds: int) -> list[tuple[int, str]]:
    """(round, target) in measuring order: A B, B A, A B, ... (A = stock, B = leasekit); 2 *
    ``rounds`` entries, empty for ``rounds`` <= 0."""
    order = []
    for k in range(rounds):
        pair = TARGETS if k % 2 == 0 else TARGETS[::-1]
        order += [(k, t) for t in pair]
    return order


def seeded_prompts(seed: int, round_index: int, n: int, length: int, vocab_size: int) -> list[list[int]]:
    """The ``n`` prompts of one round, each ``length`` token ids in 3..``vocab_size``-1: the same for
    both targets (and every call) with the same ``seed`` and ``round_index``, different every round.

    Raises:
        ValueError: ``vocab_size`` <= 3.
    """
    rng = random.Random(f"{seed}/{round_index}")
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


def route(target: Target, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, list[tuple[float, Any]]]:
    """Route ``prompts`` P -> D from ``concurrency`` client threads, ``max_tokens`` generated each.

    Returns:
        (wall seconds from first submission to last completion, ``[(latency s, RoutedResult)]`` in
        prompt order). A failed request is a result with an error, not an exception.
    """

    def one(prompt):
        t0 = time.perf_counter()
        result = target.router.generate(prompt, max_tokens)
        return time.perf_counter() - t0, result

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"client-{target.name}")
    try:
        t0 = time.perf_counter()
        results = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return wall, results


def routed_ids(results: list[tuple[float, Any]]) -> list[str]:
    """P's request ids (the lease keys) of :func:`route`'s results, those without one left out."""
    return [r.prefill.request_id for _, r in results if r.prefill.request_id]


def warm_up(target: Target, prompts: list[list[int]], concurrency: int, max_tokens: int, *,
            require_one_ok: bool = True) -> None:
    """Route ``prompts`` unmeasured and drain the pair after them.

    Raises:
        HarnessError: ``require_one_ok`` and every request failed (the pair does not serve), or the
            pair did not drain.
    """
    _, warm = route(target, prompts, concurrency, max_tokens)
    failed = [r for _, r in warm if r.decode is None or not r.decode.ok]
    if require_one_ok and len(failed) == len(warm):
        r = failed[0]
        raise HarnessError(f"every warm-up request failed on the {target.name} pair (P HTTP {r.prefill.status} "
                           f"{r.prefill.error}; D {r.decode.status if r.decode else '-'} "
                           f"{r.decode.error if r.decode else ''}); logs {target.pair.run_dir / 'logs'}")
    target.drain(routed_ids(warm))


def measure(target: Target, round_index: int, prompts: list[list[int]], concurrency: int,
            max_tokens: int) -> tuple[RunStats, list[str]]:
    """One measured round: route ``prompts`` (:func:`route`) and count what came back.

    Returns:
        (its :class:`.stats.RunStats`, latencies in seconds; P's request ids, the lease keys).
    """
    wall, results = route(target, prompts, concurrency, max_tokens)
    stats = RunStats(target.name, round_index, len(prompts), 0, 0, wall)
    for latency, r in results:
        if r.decode is not None and r.decode.ok:
            stats.ok += 1
            stats.tokens += len(r.decode.token_ids or [])
            stats.latencies_s.append(latency)
        else:
            side = r.decode if r.decode is not None else r.prefill
            stats.errors.append(f"{'D' if r.decode is not None else 'P'}: HTTP {side.status} {side.error}")
    return stats, routed_ids(results)


def queued_phase(target: Target, hold_s: float, requests: int, prompt_len: int, vocab: int, seed: int, *,
                 slots: int, max_tokens: int) -> list[str]:
    """Hold D's ``slots`` running slots with long local generations (``Router.hold_decode_slot``, as
    ``QueuedDecodeLoad`` does for one slot), prefill ``requests`` requests on P and send them to
    D, where they wait (D heartbeats their leases) for ``hold_s`` seconds once D reports them all
    waiting; then free the slots and wait for every decode. Returns P's request ids.

    Raises:
        HarnessError: the slots were not taken, the requests did not queue, or a request failed.
    """
    from leasekit.cluster.server import scrape_metrics

    router, decode = target.router, target.pair.decode
    stop = threading.Event()
    rng = random.Random(f"{seed}/queue/{hold_s}")
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    holders = [threading.Thread(target=router.hold_decode_slot, args=(prompt(16), stop), daemon=True,
                                name=f"hold-slot-{i}") for i in range(slots)]
    results: dict[int, Any] = {}
    lock = threading.Lock()

    def gauge(name):
        try:
            return scrape_metrics(decode.url).get(name, 0.0)
        except Exception:  # noqa: BLE001 - retried
            return -1.0

    def wait_gauge(name, at_least, timeout_s=60.0):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if gauge(name) >= at_least:
                return True
            time.sleep(0.1)
        return False

    def decode_one(index, p, prefill):
        # as Router.generate does: D joins the prefill's trace where the router makes one
        trace = {"traceparent": prefill.traceparent} if getattr(prefill, "traceparent", None) else {}
        r = router.decode(p, prefill.kv_transfer_params, max_tokens, routing_id=prefill.routing_id, **trace)
        with lock:
            results[index] = r

    ids: list[str] = []
    workers: list[threading.Thread] = []
    try:
        for h in holders:
            h.start()
        if not wait_gauge("vllm:num_requests_running", slots):
            raise HarnessError(f"D never reported {slots} running requests (slots not held)")
        for i in range(requests):
            p = prompt(prompt_len)
            prefill = router.prefill(p)
            if not prefill.ok:
                raise HarnessError(f"queued phase: prefill {i} failed: HTTP {prefill.status} {prefill.error}")
            ids.append(prefill.request_id)
            w = threading.Thread(target=decode_one, args=(i, p, prefill), daemon=True, name=f"queued-{i}")
            w.start()
            workers.append(w)
        if not wait_gauge("vllm:num_requests_waiting", requests):
            raise HarnessError(f"D never reported {requests} waiting requests")
        time.sleep(hold_s)
    finally:
        stop.set()
        for h in holders:
            h.join(timeout=30)
    for w in workers:
        w.join(timeout=120)
    bad = [f"#{i}: HTTP {r.status} {r.error}" for i, r in sorted(results.items()) if not r.ok]
    if len(results) < requests or bad:
        raise HarnessError(f"queued phase: {requests - len(results)} decode(s) did not return; failed: {bad[:3]}")
    return ids
