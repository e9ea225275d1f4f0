"""Timing and memory of built sides (:mod:`benchmarks.pstep.drive`), stock and LeaseKit interleaved.

Timing: ``time.perf_counter_ns`` around :func:`~benchmarks.pstep.drive.engine_step` only (the
scheduler's metadata and its ``update_connector_output`` are untimed), one sample per engine step,
garbage collection disabled inside a timed block (as ``timeit`` does) and run between rounds. The
sides take turns in blocks, in A B B A order (round k forward, round k+1 backward), so a linear drift
of the machine adds the same to each; before each block one untimed warm-up step.

Nothing may expire while timed: every lease is kept alive the way D keeps a waiting request's lease
alive, by heartbeats (one untimed step whose notifications name every live lease, at most
``REFRESH_S`` after the previous one), so deadlines stay at least ``E - REFRESH_S`` = 12 s away. Any
request id a timed step reports in ``finished_sending`` other than the one completed on purpose is
counted in ``unexpected`` (a valid run has 0).
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.pstep import drive as D

REFRESH_S = 8.0  # seconds between two keep-alive heartbeats of every live lease (E = 20 s at L = 30 s)
REFRESH_IDS = 1000  # request ids per keep-alive heartbeat (LeaseKit refuses notifications over 1 MiB)
HEARTBEAT_IDS = 16  # ids in the heartbeat of a notification step
PLEDGE_GUARD_S = 1.5  # a completed lease was granted at least this long ago (LeaseKit's grant pledge: 1 s)


@dataclass
class Samples:
    """Per-side timing samples, nanoseconds per engine step."""

    empty: list[int] = field(default_factory=list)
    notif: list[int] = field(default_factory=list)  # the step handling 1 heartbeat (16 ids) + 1 completion
    notif_minus_empty: list[int] = field(default_factory=list)  # that step minus the empty step just before
    heartbeat: list[int] = field(default_factory=list)  # D: the step sending the heartbeat of every tracked request
    unexpected: int = 0  # request ids reported finished that nothing finished on purpose (expiries)

    def summary(self) -> dict[str, Any]:
        """Per kind of step: the median (``<kind>_us``, what the goals use), mean, 99th percentile and
        maximum (µs), and the sample count."""
        out: dict[str, Any] = {"unexpected_releases": self.unexpected}
        for name in ("empty", "notif", "notif_minus_empty", "heartbeat"):
            values = sorted(getattr(self, name))
            if values:
                out[f"{name}_us"] = statistics.median(values) / 1000.0
                out[f"{name}_mean_us"] = statistics.fmean(values) / 1000.0
                out[f"{name}_p99_us"] = values[min(len(values) - 1, int(0.99 * len(values)))] / 1000.0
                out[f"{name}_max_us"] = values[-1] / 1000.0
                out[f"{name}_n"] = len(values)
        return out


def timed(side: D.Side, metadata: Any) -> tuple[int, Any]:
    """``(ns, results)`` of one engine step on ``side`` with ``metadata``; the output goes back to the
    scheduler afterwards (untimed)."""
    start = time.perf_counter_ns()
    results = D.engine_step(side.connector, metadata)
    elapsed = time.perf_counter_ns() - start
    side.finish_step(results)
    return elapsed, results


class PDriver:
    """N live leases on each P side, driven identically: the same request ids, the same notifications
    in the same order. Rep ``r`` of the notification steps completes ``request_id(r)`` (the oldest live
    lease), heartbeats the 16 after it and grants ``request_id(n + r)`` to keep N live."""

    def __init__(self, sides: list[D.PSide], n: int, batch: int = 1000) -> None:
        self.sides, self.n = sides, n
        ids = [D.request_id(i) for i in range(n)]
        self.samples = {side.label: Samples() for side in sides}
        self.refreshed: dict[str, float] = {}
        self.rep: dict[str, int] = {side.label: 0 for side in sides}
        for side in sides:
            self.refreshed[side.label] = time.perf_counter()  # the oldest lease's grant
            for start in range(0, n, batch):
                self.samples[side.label].unexpected += side.grant(ids[start:start + batch], batch, age_s=side.age_s)
                self.keep_all_alive()
        self.granted_at = time.perf_counter()

    def keep_all_alive(self) -> None:
        """:meth:`keep_alive` for every side that has leases (before each block: the others' blocks took time)."""
        for side in self.sides:
            self.keep_alive(side)

    def keep_alive(self, side: D.PSide) -> None:
        """The untimed keep-alive step when due (see module docstring)."""
        if side.label not in self.refreshed or time.perf_counter() - self.refreshed[side.label] < REFRESH_S:
            return
        live = list(side.live)
        side.deliver([side.heartbeat(live[i:i + REFRESH_IDS]) for i in range(0, len(live), REFRESH_IDS)])
        self.samples[side.label].unexpected += len(side.step().finished_sending or ())
        self.refreshed[side.label] = time.perf_counter()

    def empty_block(self, side: D.PSide, steps: int) -> None:
        """``steps`` timed engine steps with nothing new (after one untimed warm-up step)."""
        s = self.samples[side.label]
        self.keep_all_alive()
        s.unexpected += len(side.step().finished_sending or ())
        gc.disable()
        try:
            for _ in range(steps):
                self.keep_alive(side)
                ns, results = timed(side, side.metadata())
                s.empty.append(ns)
                s.unexpected += len(results.finished_sending or ())
        finally:
            gc.enable()

    def notif_block(self, side: D.PSide, reps: int) -> None:
        """``reps`` times: a timed empty step, a timed step handling one heartbeat naming 16 live leases
        and one completion releasing the oldest, and an untimed step granting one new lease."""
        s = self.samples[side.label]
        wait = PLEDGE_GUARD_S - (time.perf_counter() - self.granted_at)
        if wait > 0:
            time.sleep(wait)
        self.keep_all_alive()
        s.unexpected += len(side.step().finished_sending or ())
        gc.disable()
        try:
            for _ in range(reps):
                r = self.rep[side.label]
                self.rep[side.label] = r + 1
                done = D.request_id(r)
                self.keep_alive(side)
                base, results = timed(side, side.metadata())
                s.unexpected += len(results.finished_sending or ())
                side.deliver([side.heartbeat(D.request_id(r + 1 + i) for i in range(HEARTBEAT_IDS)),
                              side.completion(done)])
                ns, results = timed(side, side.metadata())
                finished = set(results.finished_sending or ())
                s.unexpected += len(finished - {done}) + (done not in finished)
                s.notif.append(ns)
                s.notif_minus_empty.append(ns - base)
                s.unexpected += side.grant([D.request_id(self.n + r)], age_s=side.age_s)
        finally:
            gc.enable()


class DDriver:
    """N tracked requests waiting on each D side (none read yet); empty steps and heartbeat steps."""

    def __init__(self, sides: list[D.DSide], n: int, batch: int = 1000) -> None:
        self.sides, self.n = sides, n
        self.samples = {side.label: Samples() for side in sides}
        for side in sides:
            side.handshake()
            side.track(n, batch)

    def block(self, side: D.DSide, steps: int, heartbeats: int) -> None:
        """``steps`` timed steps with nothing due, then ``heartbeats`` timed steps that each send the
        heartbeat of every tracked request (an interval elapsed), each followed by one timed empty step."""
        s = self.samples[side.label]
        side.step()
        gc.disable()
        try:
            for _ in range(steps):
                meta = side.metadata()
                ns, results = timed(side, meta)
                (s.heartbeat if meta.heartbeat_by_engine else s.empty).append(ns)
                s.unexpected += len(results.finished_recving or ()) + len(results.failed_recving or ())
            for _ in range(heartbeats):
                sent = side.wrapper.sent_count
                ns, results = timed(side, side.heartbeat_metadata())
                s.heartbeat.append(ns)
                if side.wrapper.sent_count == sent:
                    s.unexpected += 1  # no heartbeat left D
        finally:
            gc.enable()


def interleave(labels: list[str], rounds: int, run: Callable[[str, int], None]) -> None:
    """Run ``run(label, k)`` for each label in round ``k`` = 0 .. ``rounds - 1``, in A B B A order
    (even rounds forward, odd rounds backward); ``gc.collect()`` between rounds."""
    for k in range(rounds):
        for label in (labels if k % 2 == 0 else labels[::-1]):
            run(label, k)
        gc.collect()


def split(total: int, rounds: int) -> list[int]:
    """``total`` steps over ``rounds`` blocks (sizes differ by at most one)."""
    return [total // rounds + (1 if k < total % rounds else 0) for k in range(rounds)]


def memory_per_lease(side: D.PSide, n: int, heartbeats_each: int, per_step: int = 400) -> dict[str, float]:
    """Bytes per live lease (``tracemalloc``: Python allocations still alive, after ``gc.collect()``)
    once ``n`` leases are granted, and once each got ``heartbeats_each`` heartbeats (messages naming
    16 leases, ``per_step`` messages per engine step). The side is built before tracing starts, so
    only what the leases add is counted (each lease's request id string included)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ids = [D.request_id(i) for i in range(n)]
        unexpected = side.grant(ids, age_s=side.age_s)
        gc.collect()
        granted = tracemalloc.get_traced_memory()[0] - base
        messages = [side.heartbeat(ids[i:i + HEARTBEAT_IDS]) for i in range(0, n, HEARTBEAT_IDS)]
        for _ in range(heartbeats_each):
            for start in range(0, len(messages), per_step):
                side.deliver(messages[start:start + per_step])
                unexpected += len(side.step().finished_sending or ())
        del messages
        gc.collect()
        extended = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return {"n": n, "live": len(side.live), "bytes_per_lease_granted": granted / n,
            "bytes_per_lease_after_heartbeats": extended / n, "heartbeats_each": heartbeats_each,
            "unexpected_releases": unexpected}
