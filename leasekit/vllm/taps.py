"""What LeaseKitConnector puts between vLLM's NIXL worker and NIXL: a notification tap, the stand-in
metadata for delayed heartbeats, and rate-limited telemetry error reports. No vLLM import here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from leasekit.lease.codec import HEARTBEAT_PREFIX as _HEARTBEAT_TEXT
from leasekit.telemetry.lease_log import RateLimitedWarning

HEARTBEAT_PREFIX = _HEARTBEAT_TEXT.encode()
"""``b"HB:"``: heartbeat notifications are ``b"HB:" + b",".join(ids)`` (vllm 0.32.0 and 0.33.0
``nixl/base_worker.py``; the ``heartbeat_prefix`` wire record of :mod:`leasekit.vllm.needs`), the
prefix of LeaseKit's codec (:mod:`leasekit.lease.codec`) encoded."""


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
        self.rewrite: Any = None  # (agent_name, notif_msg, started_s) -> the heartbeat bytes to send

    def send_notif(self, agent_name: str, notif_msg: bytes, *args: Any, **kwargs: Any) -> Any:
        """NIXL ``send_notif``; heartbeats (``HB:``) are reported to ``on_heartbeat_sent`` with
        whether the send raised (the exception still propagates to vLLM, which logs it at DEBUG);
        ``last_send_started`` holds the ``perf_counter`` seconds read just before the send, and
        ``rewrite`` (if set) may change the heartbeat's bytes on the wire (the callback still gets the
        original)."""
        if self._on_heartbeat_sent is None or not bytes(notif_msg).startswith(HEARTBEAT_PREFIX):
            return self._wrapped.send_notif(agent_name, notif_msg, *args, **kwargs)
        self.last_send_started = time.perf_counter()
        wire = notif_msg if self.rewrite is None else self.rewrite(agent_name, notif_msg, self.last_send_started)
        try:
            result = self._wrapped.send_notif(agent_name, wire, *args, **kwargs)
        except Exception:
            self._on_heartbeat_sent(agent_name, notif_msg, False)
            raise
        self._on_heartbeat_sent(agent_name, notif_msg, True)
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
        if name in NotificationTap.OWN_ATTRIBUTES:  # not set yet (a half-built tap): no recursion
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """The tap's own attributes are set on the tap; every other one on the wrapped object."""
        if name in NotificationTap.OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        """Deletes on the tap for its own attributes, else on the wrapped object (``mock.patch`` undo)."""
        if name in NotificationTap.OWN_ATTRIBUTES:
            object.__delattr__(self, name)
        else:
            delattr(self._wrapped, name)


class HeartbeatBatch:
    """Minimal metadata carrying a delayed ``heartbeat_by_engine`` (all ``_send_heartbeats`` reads)."""

    def __init__(self, heartbeat_by_engine: dict):
        self.heartbeat_by_engine = heartbeat_by_engine
