"""The grant pledge: P promises D, in ``kv_transfer_params``, not to free a lease's KV blocks before a time
on P's clock, whatever completions arrive; D proves a read finished before it without asking P.

Pure logic (no vLLM, no I/O, clocks passed in). The protocol (docs/fail-closed.md, "The pledge"):

- P's scheduler adds ``"leasekit_pledge": [until_us, clock_id]`` to the ``kv_transfer_params`` of a
  marked grant (integer microseconds, rounded down: a router re-encoding floats cannot round it up):
  ``until_us / 1e6`` is ``min(grant + W, grant + (deadline - grant) / K)`` on P's ``time.perf_counter``
  (:func:`pledge_until`)
  (``W`` = ``leasekit_pledge_s``), ``clock_id`` names that clock (:func:`leasekit.vllm.clockid.local_clock_id`).
  P's worker frees the blocks no earlier than ``until_s`` even after D's completion (it holds them back)
  and its lease deadline is never earlier than ``until_s`` either, so no path frees them before: not a
  completion from a second D the router sent the same params to, not a forger, not an earlier read.
- Every heartbeat acknowledgement carries P's clock reading ``p`` (taken after the heartbeat arrived) and
  its clock id. D began sending that heartbeat at ``s`` on its own clock, so ``p`` was read no earlier than
  ``s``. At any later D instant ``t``, P's clock reads at most ``p + (t - s) * K`` with
  ``K = (1 + RATE_ERROR) / (1 - RATE_ERROR)``: both clocks advance at a rate within ``RATE_ERROR`` of true
  time. :class:`RemoteClockBound` keeps that bound per clock id.
- A read D saw finished at ``t`` with ``bound(t) < until_s`` finished before P could free the blocks:
  it is verified with no wait. Otherwise D waits for an ack or P's verdict as before.

``RATE_ERROR`` is 10 %: Linux slews ``CLOCK_MONOTONIC`` (what ``perf_counter`` reads) through
``adjtimex``: the tick may be set within +-10 % of nominal (``ADJ_TICK``, 900000/USER_HZ..1100000/USER_HZ
microseconds, Linux ``kernel/time/timekeeping.c`` ``timekeeping_validate_timex``), the frequency within
+-500 ppm (``MAXFREQ``, ``kernel/time/ntp.c``); chrony's default ``maxslewrate`` (83333 ppm) is inside it. A clock that jumps forward (a VM paused and resumed on a clock that counts the
pause) breaks this assumption, as it breaks every lease timer, vLLM's own included.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

PLEDGE_PARAM = "leasekit_pledge"
"""Key of the pledge in the ``kv_transfer_params`` P returns: ``[until_us, clock_id]``."""

RATE_ERROR = 0.10
"""Largest relative rate error of either host's ``CLOCK_MONOTONIC`` against true time (Linux ADJ_TICK range)."""

RATE_FACTOR = (1.0 + RATE_ERROR) / (1.0 - RATE_ERROR)
"""``K``: P's clock advances at most ``K`` seconds per second of D's clock."""

CLOCK_ID_PATTERN = r"[0-9A-Za-z_.-]{1,64}"
"""What a clock id may be (leasekit/vllm/clockid.py makes 16 hex digits)."""
_CLOCK_ID = re.compile(CLOCK_ID_PATTERN)
SAMPLES_PER_CLOCK = 16
MAX_CLOCKS = 1024


@dataclass(frozen=True)
class Pledge:
    """P's promise for one grant: no block of it is freed before ``until_s`` on clock ``clock_id``."""

    until_s: float
    clock_id: str


def encode_pledge(until_s: float, clock_id: str) -> list:
    """The ``kv_transfer_params`` value of a pledge: ``[floor(until_s * 1e6), clock_id]`` (int microseconds)."""
    return [math.floor(until_s * 1e6), clock_id]


def parse_pledge(value: object) -> Pledge | None:
    """The pledge of a ``kv_transfer_params`` value ``[until_us, clock_id]``, or None when absent or
    malformed (a non-negative int below 2**62 and a string matching :data:`CLOCK_ID_PATTERN`).
    ``until_s`` is ``(until_us - 1) / 1e6``: one microsecond earlier, so that the float division never
    rounds past P's promise. Never raises: a bad pledge only costs the fast path."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    until, clock = value
    if isinstance(until, bool) or not isinstance(until, int) or not 0 <= until < 1 << 62:
        return None
    if not isinstance(clock, str) or not _CLOCK_ID.fullmatch(clock):
        return None
    return Pledge((until - 1) / 1e6, clock)


def pledge_until(grant_s: float, pledge_s: float, deadline_s: float) -> float:
    """``min(grant_s + pledge_s, grant_s + (deadline_s - grant_s) / K)``, seconds on P's clock: the pledge
    ends before the lease's first deadline by the rate margin, so that P's reaper cannot free the blocks
    before it either, even on a P worker whose clock (another host) runs up to 10 % off the scheduler's."""
    return min(grant_s + pledge_s, grant_s + (deadline_s - grant_s) / RATE_FACTOR)


class RemoteClockBound:
    """Upper bounds of remote clocks read through D's own, from acknowledgement samples, per key (the gate
    uses ``(P agent, clock id)``: samples of one P worker never bound another's clock, even where two
    clocks share an id, e.g. processes restored from one snapshot).

    A sample ``(s, p)``: D began a send at ``s`` (its clock, seconds) and the remote read ``p`` (its
    clock, seconds) after that send arrived. For a D instant ``t >= s`` the remote clock reads at most
    ``p + (t - s) * K``; for ``t < s`` at most ``p``. The bound at ``t`` is the least over the last
    :data:`SAMPLES_PER_CLOCK` samples of that key. Holds at most :data:`MAX_CLOCKS` keys (the least
    recently sampled forgotten first). Pure; not thread-safe.

    Args:
        rate_factor: ``K`` (>= 1), default :data:`RATE_FACTOR`.

    Raises:
        ValueError: ``rate_factor`` is not a finite number >= 1.
    """

    def __init__(self, rate_factor: float = RATE_FACTOR):
        if not (isinstance(rate_factor, (int, float)) and math.isfinite(rate_factor) and rate_factor >= 1):
            raise ValueError(f"rate_factor={rate_factor!r}: must be a finite number >= 1")
        self.rate_factor = float(rate_factor)
        self._samples: dict[Hashable, deque[tuple[float, float]]] = {}

    def add_sample(self, key: Hashable, sent_s: float, remote_now_s: float, received_s: float | None = None) -> bool:
        """Record that the remote clock of ``key`` read ``remote_now_s`` after a send D began at ``sent_s``
        (and, if given, before D received the answer at ``received_s``). Non-finite values are ignored.

        Returns:
            True when the new sample contradicts the kept ones (the remote read more than their bound
            allows at ``received_s``: another clock under the same id, or a rate beyond ``K``): they are
            dropped and only the new one is kept. Else False."""
        if not (math.isfinite(sent_s) and math.isfinite(remote_now_s)):
            return False
        contradicted = False
        samples = self._samples.pop(key, None)
        if samples is None:
            samples = deque(maxlen=SAMPLES_PER_CLOCK)
        elif received_s is not None and math.isfinite(received_s) and samples:
            bound = min(p + (received_s - s) * self.rate_factor if received_s >= s else p for s, p in samples)
            if remote_now_s > bound + 1e-6:  # beyond float rounding (the wire's resolution is 1 us)
                samples.clear()
                contradicted = True
        samples.append((float(sent_s), float(remote_now_s)))
        self._samples[key] = samples  # most recently sampled last
        while len(self._samples) > MAX_CLOCKS:
            del self._samples[next(iter(self._samples))]
        return contradicted

    def upper_bound(self, key: Hashable, at_s: float) -> float | None:
        """The most the remote clock of ``key`` can read at D instant ``at_s`` (seconds), or None with no sample."""
        samples = self._samples.get(key)
        if not samples:
            return None
        k = self.rate_factor
        return min(p + (at_s - s) * k if at_s >= s else p for s, p in samples)

    def covers(self, pledge: Pledge | None, at_s: float, keys: Iterable[Hashable]) -> bool:
        """Whether ``pledge`` provably still held at D instant ``at_s`` on every clock of ``keys`` (the P
        workers a read used): each has a sample and its bound there is below ``pledge.until_s``. False
        without a pledge or without keys."""
        keys = list(keys)
        if pledge is None or not keys:
            return False
        for key in keys:
            bound = self.upper_bound(key, at_s)
            if bound is None or not bound < pledge.until_s:
                return False
        return True


class PledgeBook:
    """P's pledge holds (pure). ``holds``: request id -> pledge end; ``deferred``: request id -> (pledge
    end, completion time); ``early``: request id -> completion time (completed before its grant). All
    times in seconds on the worker clock."""

    def __init__(self) -> None:
        self.holds: dict[str, float] = {}
        self.deferred: dict[str, tuple[float, float]] = {}
        self.early: dict[str, float] = {}

    def holding(self, req_id: str) -> bool:
        """Whether ``req_id`` completed and is still pinned (deferred for its pledge, or early)."""
        return req_id in self.deferred or req_id in self.early

    def defer(self, req_id: str, now: float) -> bool:
        """A release at ``now``: whether it waits for ``req_id``'s pledge (kept in :attr:`deferred`)."""
        hold = self.holds.pop(req_id, None)
        if hold is None or now >= hold:
            return False
        self.deferred[req_id] = (hold, now)
        return True

    def grant_arrived(self, req_id: str, now: float, longest_s: float) -> None:
        """The grant of an early completion reached the worker at ``now``: it is freed at
        ``max(pledge end, now + longest_s)`` (``longest_s``: the whole pledge ``W * K``, seconds)."""
        completed = self.early.pop(req_id)
        hold = max(self.holds.pop(req_id, now), now + longest_s)
        self.deferred[req_id] = (hold, completed)

    def due(self, now: float) -> list[tuple[str, float]]:
        """Remove and return the deferred leases whose pledge ended by ``now``: (request id, seconds held
        since the completion)."""
        if not self.deferred:
            return []
        out = []
        for req_id, (hold, completed) in list(self.deferred.items()):
            if now >= hold:
                del self.deferred[req_id]
                out.append((req_id, max(0.0, now - completed)))
        return out
