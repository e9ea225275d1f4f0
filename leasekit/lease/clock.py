"""Clock-offset estimation between two processes' monotonic clocks, and the turn-2 expiry check.

All times are seconds on a process's ``time.perf_counter`` (passed in: nothing here reads a clock).
``offset = remote - local``: a remote instant ``r`` is the local instant ``r - offset``.

Sources (vllm 0.32.0, ``distributed/kv_transfer/kv_connector/v1/nixl/``):

- ``base_worker.py: _nixl_handshake``: for each metadata query, ``start_time`` and ``recv_time`` are
  local ``perf_counter`` readings around the round trip and ``remote_perf`` is the peer's
  ``perf_counter`` echoed by its handshake listener (``base_scheduler.py``); the sample with the
  lowest ``rtt = recv_time - start_time`` (strictly lower: the first wins a tie) sets
  ``offset = remote_perf - (start_time + recv_time) / 2``.
- ``pull_worker.py: _is_turn2_read_expired``: P declines a turn-2 read of D's cached blocks when
  ``perf_counter() + _KV_BLOCKS_EXPIRY_SAFETY_MARGIN >= blocks_expiry_time - clock_offset``
  with ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN = 5.0``.

Error bound: the remote reading was taken somewhere inside ``[t_send, t_recv]`` (local time), so the
midpoint estimate is off by at most ``rtt / 2`` whatever the split between the two one-way delays.
"""

from __future__ import annotations

import math

KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S = 5.0
"""vLLM's ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` (``nixl/pull_worker.py``), seconds."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    return float(value)


class ClockOffsetEstimator:
    """Offset of a remote clock from the local one, from handshake round trips (lowest RTT wins).

    Feed it one :meth:`add_sample` per round trip; read :attr:`offset_s` (``remote - local``),
    :attr:`rtt_s` and :attr:`error_bound_s` of the best sample. Same rule as vLLM's
    ``nixl/base_worker.py: _nixl_handshake``, including the tie (the earlier sample is kept).
    Holds O(1) state. Pure; not thread-safe.
    """

    def __init__(self) -> None:
        self._offset_s: float | None = None
        self._rtt_s: float | None = None
        self._samples = 0

    def add_sample(self, t_send_s: float, remote_now_s: float, t_recv_s: float) -> bool:
        """Add one round trip: local send time, the peer's clock reading, local receive time.

        Returns:
            True when this sample became the best (lowest RTT so far), else False.

        Raises:
            ValueError: naming the argument, if a value is not a finite number (bool refused) or
                ``t_recv_s < t_send_s``. A rejected sample changes nothing.
        """
        t_send = _finite("t_send_s", t_send_s)
        remote_now = _finite("remote_now_s", remote_now_s)
        t_recv = _finite("t_recv_s", t_recv_s)
        if t_recv < t_send:
            raise ValueError(
                f"t_recv_s ({t_recv!r}) precedes t_send_s ({t_send!r}): both must be the same local "
                "monotonic clock, read before sending and after receiving"
            )
        self._samples += 1
        rtt = t_recv - t_send
        if self._rtt_s is not None and not rtt < self._rtt_s:
            return False
        self._rtt_s = rtt
        self._offset_s = remote_now - (t_send + t_recv) / 2
        return True

    @property
    def offset_s(self) -> float | None:
        """``remote - local`` in seconds from the lowest-RTT sample; None before any sample."""
        return self._offset_s

    @property
    def rtt_s(self) -> float | None:
        """Round-trip time of the best sample in seconds; None before any sample."""
        return self._rtt_s

    @property
    def error_bound_s(self) -> float | None:
        """``|offset_s - true offset| <= rtt_s / 2`` (seconds); None before any sample."""
        return None if self._rtt_s is None else self._rtt_s / 2

    @property
    def samples(self) -> int:
        """How many samples were accepted (rejected ones are not counted)."""
        return self._samples


def remote_to_local(remote_t_s: float, offset_s: float) -> float:
    """A remote clock instant on the local clock: ``remote_t_s - offset_s`` (seconds).

    As vLLM's ``deadline = blocks_expiry_time - clock_offset`` (``nixl/pull_worker.py``).
    Raises ValueError for a non-finite argument.
    """
    return _finite("remote_t_s", remote_t_s) - _finite("offset_s", offset_s)


def local_to_remote(local_t_s: float, offset_s: float) -> float:
    """A local clock instant on the remote clock: ``local_t_s + offset_s`` (seconds).

    Raises ValueError for a non-finite argument.
    """
    return _finite("local_t_s", local_t_s) + _finite("offset_s", offset_s)


def turn2_read_expired(
    now_local_s: float,
    remote_deadline_s: float,
    offset_s: float,
    margin_s: float = KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S,
) -> bool:
    """vLLM's turn-2 check: is D's cached-block deadline (nearly) past, seen from P?

    ``now_local_s + margin_s >= remote_deadline_s - offset_s``; exactly equal counts as expired
    (vLLM's ``>=``). Source: ``nixl/pull_worker.py: _is_turn2_read_expired`` (the caller there
    skips the check when the deadline is absent; pass only a real deadline here).

    Args:
        now_local_s: P's clock now.
        remote_deadline_s: D's ``remote_blocks_expiry_time`` (D's clock).
        offset_s: ``D - P`` clock offset (:attr:`ClockOffsetEstimator.offset_s`).
        margin_s: safety margin, vLLM's 5.0 s.

    Raises:
        ValueError: an argument is not finite, or ``margin_s < 0``.
    """
    margin = _finite("margin_s", margin_s)
    if margin < 0:
        raise ValueError(f"margin_s must be >= 0, got {margin_s!r}")
    deadline_local = _finite("remote_deadline_s", remote_deadline_s) - _finite("offset_s", offset_s)
    return _finite("now_local_s", now_local_s) + margin >= deadline_local


def turn2_read_expired_strict(
    now_local_s: float,
    remote_deadline_s: float,
    offset_s: float,
    error_bound_s: float,
    margin_s: float = KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S,
) -> bool:
    """leasekit's stricter turn-2 rule: vLLM's check with the offset's error bound also subtracted.

    ``now_local_s + margin_s >= (remote_deadline_s - error_bound_s) - offset_s``. The estimated offset
    may be off by up to ``error_bound_s`` (``rtt / 2`` of the best sample) in either direction, so
    the deadline is taken at its earliest possible local instant: with it, an offset error alone
    can never let P read blocks D has already freed. vLLM does not do this (its margin of 5 s only
    covers the error while ``rtt / 2`` stays below 5 s minus the read time).

    Raises:
        ValueError: an argument is not finite, or ``margin_s`` or ``error_bound_s`` is negative.
    """
    bound = _finite("error_bound_s", error_bound_s)
    if bound < 0:
        raise ValueError(f"error_bound_s must be >= 0, got {error_bound_s!r}")
    remote_deadline = _finite("remote_deadline_s", remote_deadline_s)
    return turn2_read_expired(now_local_s, remote_deadline - bound, offset_s, margin_s)
