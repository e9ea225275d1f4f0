"""What LeaseKitConnector puts between vLLM's NIXL worker and NIXL: a notification tap, the stand-in
metadata for delayed heartbeats, and rate-limited telemetry error reports. No vLLM import here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from leasekit.lease.codec import HEARTBEAT_PREFIX as _HEARTBEAT_TEXT
from leasekit.telemetry.lease_log import RateLimitedWarning

HEARTBEAT_PREFIX = _HEARTBEAT_TEXT.encode()
"""``b"HB:"``: heartbeat notifications are ``b"HB:" + b",".join(ids)`` (vllm 0.32.0 and 0.33.0
``nixl/base_worker.py``; the ``heartbeat_prefix`` wire record of :mod:`leasekit.vllm.needs`), the
prefix of LeaseKit's codec (:mod:`leasekit.lease.codec`) encoded."""

MAX_HEARTBEAT_CHUNK_BYTES = 256 * 1024
"""Largest heartbeat notification a LeaseKit D sends, in bytes: a longer heartbeat is split into several, each
a complete ``HB:`` heartbeat within this size (:func:`split_heartbeat`). A quarter of LeaseKit P's default
ceiling (1 MiB, :data:`leasekit.lease.codec.DEFAULT_MAX_BYTES`), which drops a larger notification whole."""


class WireHeartbeat(NamedTuple):
    """One heartbeat notification a tap's ``rewrite`` asks it to send: ``wire``, the bytes NIXL sends, and
    ``original``, ``b"HB:" + b",".join(ids)`` of the ids it carries as vLLM named them (no lease proof, no
    sequence token): what ``on_heartbeat_sent`` is told."""

    wire: bytes
    original: bytes


def split_heartbeat(ids: Sequence[str], wire_ids: Sequence[str], limit: int = MAX_HEARTBEAT_CHUNK_BYTES
                    ) -> list[WireHeartbeat]:
    """Split one heartbeat into complete heartbeats of at most ``limit`` bytes each.

    Args:
        ids: the heartbeat's ids as vLLM named them (``original`` of each part).
        wire_ids: the same ids as they go on the wire (same length and order; e.g. with a lease proof).
        limit: bytes per part, ``b"HB:"`` included (> ``len(b"HB:")``; a caller that appends a sequence token
            passes the limit less the token's room).

    Returns:
        The parts, in order, together carrying every id exactly once (consecutive runs of ``wire_ids``);
        an id whose part would exceed ``limit`` even alone is sent alone (P refuses it, the others go through).
        One part, ``[WireHeartbeat(b"HB:", b"HB:")]``, for no ids.

    Raises:
        ValueError: ``ids`` and ``wire_ids`` differ in length.
        UnicodeEncodeError: an id holds a lone surrogate (vLLM's own ``encode`` would have raised first).
    """
    if len(ids) != len(wire_ids):
        raise ValueError(f"{len(ids)} ids but {len(wire_ids)} wire ids")
    parts: list[WireHeartbeat] = []
    start, size = 0, len(HEARTBEAT_PREFIX)
    for i, wire_id in enumerate(wire_ids):
        n = len(wire_id.encode()) + (1 if i > start else 0)  # "," before every id but a part's first
        if i > start and size + n > limit:
            parts.append(_heartbeat_part(ids, wire_ids, start, i))
            start, size, n = i, len(HEARTBEAT_PREFIX), n - 1
        size += n
    parts.append(_heartbeat_part(ids, wire_ids, start, len(wire_ids)))
    return parts


def _heartbeat_part(ids: Sequence[str], wire_ids: Sequence[str], start: int, end: int) -> WireHeartbeat:
    return WireHeartbeat(HEARTBEAT_PREFIX + ",".join(wire_ids[start:end]).encode(),
                         HEARTBEAT_PREFIX + ",".join(ids[start:end]).encode())


class TelemetryErrors:
    """Reports telemetry failures as a WARNING at most once per ``interval_s`` seconds, with the
    count suppressed (:class:`~leasekit.telemetry.lease_log.RateLimitedWarning`); never raises.

    Args:
        logger: where the warnings go; interval_s: seconds between two records (> 0).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self._warning = RateLimitedWarning(logger, interval_s)

    def report(self, where: str, exc: BaseException) -> None:
        """Log that telemetry failed in ``where`` with ``exc`` (rate-limited)."""
        self._warning.warn(
            "LeaseKit telemetry failed in %s (%s: %s). Serving continues; lease spans may be incomplete.",
            where, type(exc).__name__, exc,
        )


class NotificationTap:
    """Wraps vLLM's NIXL wrapper (args: ``wrapped``; ``on_heartbeat_sent(agent, msg, ok)`` or None).

    Sees every ``send_notif`` (heartbeats reported and possibly rewritten) and every
    ``get_new_notifs`` batch (kept in ``last_batch``); otherwise transparent, so that code written
    for the NIXL wrapper (vLLM's worker, and vLLM's own unit tests, which inject failures and fake
    peers by setting attributes on ``worker.nixl_wrapper``) works unchanged through it:

    - reads of any other attribute come from the wrapped object;
    - writes and deletes of any attribute except the tap's own (:attr:`OWN_ATTRIBUTES`) go to the
      wrapped object, so a replaced ``send_notif`` / ``get_new_notifs`` (a mock, a failing stub) is
      what the tap's methods call, and the tap keeps seeing every call;
    - ``isinstance(tap, wrapped.__class__)`` holds (``__class__`` is the wrapped object's class, as for
      :class:`unittest.mock.Mock` with a spec); ``type(tap)`` stays :class:`NotificationTap`.
    """

    OWN_ATTRIBUTES = frozenset({"_wrapped", "last_batch", "_agent_by_msg", "_on_heartbeat_sent",
                                "last_send_started", "rewrite"})
    """Attributes kept on the tap itself; every other attribute lives on the wrapped NIXL wrapper."""

    def __init__(self, wrapped: Any, on_heartbeat_sent: Any = None):
        self._wrapped = wrapped
        self.last_batch: dict[str, list[bytes]] = {}
        self._agent_by_msg: dict[bytes, str] | None = None
        self._on_heartbeat_sent = on_heartbeat_sent  # (agent_name, notif_msg, ok) -> None
        self.last_send_started: float | None = None  # perf_counter() just before the last heartbeat send
        self.rewrite: Any = None  # (agent_name, notif_msg, started_s) -> bytes, or a list of WireHeartbeat

    def send_notif(self, agent_name: str, notif_msg: bytes, *args: Any, **kwargs: Any) -> Any:
        """NIXL ``send_notif``. Anything but a heartbeat (``HB:``) goes through unchanged. A heartbeat:
        ``last_send_started`` holds the ``perf_counter`` seconds read just before the first send, and
        ``rewrite(agent_name, notif_msg, last_send_started)`` (if set) says what goes on the wire: bytes (one
        notification) or a list of :class:`WireHeartbeat` (several, sent in order; a heartbeat too large for
        one notification). ``on_heartbeat_sent(agent_name, original, ok)`` is told once per notification
        actually attempted, with the ids that notification carries as vLLM named them (``notif_msg`` itself
        for a single one) and whether its send returned (``ok``) or raised. The first send that raises stops
        the rest (as vLLM's own single send would: the later parts are neither sent nor reported) and its
        exception propagates to vLLM, which logs it at DEBUG. Returns the last send's result."""
        if self._on_heartbeat_sent is None or not bytes(notif_msg).startswith(HEARTBEAT_PREFIX):
            return self._wrapped.send_notif(agent_name, notif_msg, *args, **kwargs)
        self.last_send_started = time.perf_counter()
        wire = notif_msg if self.rewrite is None else self.rewrite(agent_name, notif_msg, self.last_send_started)
        parts = [WireHeartbeat(wire, notif_msg)] if isinstance(wire, (bytes, bytearray, memoryview)) else wire
        result = None
        for part in parts:
            try:
                result = self._wrapped.send_notif(agent_name, part.wire, *args, **kwargs)
            except Exception:
                self._on_heartbeat_sent(agent_name, part.original, False)
                raise
            self._on_heartbeat_sent(agent_name, part.original, True)
        return result

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        """NIXL ``get_new_notifs``; the batch (agent name -> messages) is kept in ``last_batch``."""
        batch = self._wrapped.get_new_notifs(*args, **kwargs)
        self.last_batch = batch
        self._agent_by_msg = None
        return batch

    def agent_of(self, msg: bytes) -> str | None:
        """The agent that sent ``msg`` in the last batch (None if not found)."""
        if self._agent_by_msg is None:
            self._agent_by_msg = {m: agent for agent, msgs in self.last_batch.items() for m in msgs}
        return self._agent_by_msg.get(msg)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The wrapped object's class, so that ``isinstance`` sees through the tap."""
        return self._wrapped.__class__

    def __getattr__(self, name: str) -> Any:
        """Attributes the tap does not define come from the wrapped object (AttributeError if absent)."""
        if name in type(self).OWN_ATTRIBUTES:  # not set yet (a half-built tap): no recursion
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """The tap's own attributes are set on the tap; every other one on the wrapped object."""
        if name in type(self).OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        """Deletes on the tap for its own attributes, else on the wrapped object (``mock.patch`` undo)."""
        if name in type(self).OWN_ATTRIBUTES:
            object.__delattr__(self, name)
        else:
            delattr(self._wrapped, name)


class PushNotificationTap(NotificationTap):
    """The tap of a push-mode worker (:class:`leasekit.vllm.push.LeaseKitPushWorker`): as
    :class:`NotificationTap`, except that ``get_new_notifs`` (called by vLLM's ``nixl-push-writer`` thread, which
    owns it in push mode) hands the batch to ``flow`` (a :class:`leasekit.vllm.pushflow.PushFlow`, set after
    construction) and returns only what the flow lets vLLM's writer act on: the accepted ``PUSH_REG``
    registrations. Without a flow it is transparent."""

    OWN_ATTRIBUTES = NotificationTap.OWN_ATTRIBUTES | {"flow"}

    def __init__(self, wrapped: Any, on_heartbeat_sent: Any = None):
        super().__init__(wrapped, on_heartbeat_sent)
        self.flow: Any = None

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        """NIXL ``get_new_notifs`` through the flow (:meth:`leasekit.vllm.pushflow.PushFlow.writer_batch`), with the
        instant (perf_counter s) the poll began: everything delivered before it is in this batch."""
        polled_at = time.perf_counter()
        batch = super().get_new_notifs(*args, **kwargs)
        return batch if self.flow is None else self.flow.writer_batch(batch, polled_at)


class HeartbeatBatch:
    """Minimal metadata carrying a delayed ``heartbeat_by_engine`` (all ``_send_heartbeats`` reads)."""

    def __init__(self, heartbeat_by_engine: dict):
        self.heartbeat_by_engine = heartbeat_by_engine
