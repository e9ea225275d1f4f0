"""Structured lease logs: one log record per lease event, JSON lines when asked.

Every record goes to the logger ``vllm.leasekit.lease`` (so, by default, through vLLM's own log
handlers and format) with the event's fields as ``extra`` attributes and ``event=<kind>``. With
``LEASEKIT_LOG_FORMAT=json`` the logger gets its own stderr handler with python-json-logger's
``JsonFormatter`` (one JSON object per line: time, level, message, event, request_id, tp_rank,
engine_id, kv_role, outcome, remote_agent, times in seconds) and stops propagating, so the lines
are not printed twice.

A D worker is named by :func:`leasekit.lease.peerref.peer_ref` of its NIXL agent name (``peer-<12 hex>``),
never by the name: lease events already carry the reference, and :class:`RateLimitedWarning` replaces a
``remote_agent`` field (and any message argument equal to it) by its reference.

Levels: grant, extend, release: DEBUG (volume O(requests x heartbeats) for extends); abort: INFO;
expire: WARNING (blocks reclaimed from a D that went silent); late read: ERROR (a read may have
used freed blocks, docs/lease-model.md invariant 5), WARNING when the reading D fails closed (``fail_closed=true``:
P told it to discard the read, docs/fail-closed.md); peer returned (a D agent heard from again after leases of
it expired while it was silent: it was stalled, not dead): WARNING. Heartbeat send failures (D): WARNING, at most one
record per ``interval_s`` with the count of suppressed ones.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict

from leasekit.lease.peerref import peer_ref
from leasekit.telemetry import lease_events as ev
from leasekit.telemetry.lease_events import LeaseEvent

LOGGER_NAME = "vllm.leasekit.lease"
LOG_FORMAT_ENV = "LEASEKIT_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
_JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"

_LEVELS = {
    ev.GRANT: logging.DEBUG,
    ev.EXTEND: logging.DEBUG,
    ev.RELEASE: logging.DEBUG,
    ev.ABORT: logging.INFO,
    ev.EXPIRE: logging.WARNING,
    ev.LATE_READ: logging.ERROR,
    ev.PEER_RETURNED: logging.WARNING,
}


class LogConfigError(ValueError):
    """``LEASEKIT_LOG_FORMAT`` holds a value other than ``text`` or ``json``."""


def lease_logger(env: dict[str, str] | None = None) -> logging.Logger:
    """The lease logger, with a JSON stderr handler when ``LEASEKIT_LOG_FORMAT=json``.

    Idempotent (one handler however often it is called).

    Raises:
        LogConfigError: ``LEASEKIT_LOG_FORMAT`` is not one of ``text``, ``json`` (names the fix).
    """
    env = os.environ if env is None else env
    fmt = (env.get(LOG_FORMAT_ENV) or "text").strip().lower()
    if fmt not in LOG_FORMATS:
        raise LogConfigError(
            f"{LOG_FORMAT_ENV}={env.get(LOG_FORMAT_ENV)!r} is not allowed; use one of {', '.join(LOG_FORMATS)}"
        )
    logger = logging.getLogger(LOGGER_NAME)
    if fmt == "json" and not any(getattr(h, "_leasekit_json", False) for h in logger.handlers):
        from pythonjsonlogger.json import JsonFormatter

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(_JSON_FIELDS, rename_fields={"asctime": "time", "levelname": "level"}))
        handler._leasekit_json = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    return logger


class LeaseLogObserver:
    """Logs each :class:`LeaseEvent` as one record (see the module docstring for levels and fields).

    Args:
        logger: where records go (default: :func:`lease_logger`).
    """

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or lease_logger()

    def wants(self, kind: str) -> bool:
        """Whether an event of ``kind`` would be logged at all (late reads: checked again per event)."""
        return kind == ev.LATE_READ or self.logger.isEnabledFor(_LEVELS.get(kind, logging.INFO))

    def __call__(self, event: LeaseEvent) -> None:
        """Log ``event`` at its kind's level; fields that are None are left out."""
        level = _LEVELS.get(event.kind, logging.INFO)
        if event.kind == ev.LATE_READ and event.fail_closed:
            level = logging.WARNING  # D discards that read (docs/fail-closed.md): no wrong tokens
        if not self.logger.isEnabledFor(level):
            return
        fields = {k: v for k, v in asdict(event).items() if v is not None}
        fields["event"] = fields.pop("kind")
        fields["request_id"] = fields.pop("req_id")
        details = ""
        if event.outcome:
            details += f" outcome={event.outcome}"
        if event.cause:
            details += f" cause={event.cause}"
        if event.peer_state:
            details += f" peer_state={event.peer_state}"
        if event.remote_agent and event.kind in (ev.EXPIRE, ev.LATE_READ, ev.PEER_RETURNED):
            details += f" peer={event.remote_agent}"
        if event.count is not None:
            details += f" expired_while_silent={event.count}"
        if event.reclaim_lag_s is not None:
            details += f" reclaim_lag_s={event.reclaim_lag_s:.3f}"
        if event.fail_closed is not None:
            details += f" fail_closed={str(event.fail_closed).lower()}"
        self.logger.log(
            level,
            "kv lease %s request_id=%s tp_rank=%d engine=%s%s",
            event.kind, event.req_id, event.tp_rank, event.engine_id, details,
            extra=fields,
        )


MIN_REDACTED_CHARS = 8
"""Shortest agent name :class:`RateLimitedWarning` also replaces inside other arguments' text."""


def _redact(arg: object, agent: object, ref: str) -> object:
    """``arg`` with the agent name ``agent`` shown as its reference ``ref`` (see :meth:`RateLimitedWarning.warn`);
    never raises (an argument that cannot be compared or printed is dropped for ``"?"``)."""
    try:
        if arg is agent or (isinstance(arg, (str, bytes)) and arg == agent):
            return ref
        name, text = agent.decode("utf-8", "replace") if isinstance(agent, bytes) else str(agent), str(arg)
        if text == name or text == str(agent):
            return ref
        if len(name) >= MIN_REDACTED_CHARS and name in text:
            return text.replace(name, ref)
        return arg
    except Exception:
        return "?"


class RateLimitedWarning:
    """Logs a WARNING at most once per ``interval_s`` seconds, with how many were suppressed.

    Args:
        logger: where the warning goes.
        interval_s: minimum seconds between two records (> 0).
        clock: monotonic seconds.

    Raises:
        ValueError: ``interval_s`` is not > 0.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, clock=time.monotonic):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._last = float("-inf")
        self.suppressed = 0

    def warn(self, msg: str, *args: object, **extra: object) -> bool:
        """Log ``msg % args`` unless one was logged less than ``interval_s`` ago; True if logged.

        ``extra["remote_agent"]``, if given, is a NIXL agent name: it is logged as its
        :func:`~leasekit.lease.peerref.peer_ref`, and so is every argument equal to it (or whose ``str()`` is),
        so a message like ``"from agent %s", agent`` never shows the name; an argument whose ``str()`` contains
        the name (an exception's text, say) is logged as that text with the name replaced by the reference
        (names of at least :data:`MIN_REDACTED_CHARS` characters: NIXL's are UUIDs)."""
        now = self._clock()
        if now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        agent = extra.get("remote_agent")
        if agent is not None:
            ref = extra["remote_agent"] = peer_ref(agent)
            args = tuple(_redact(a, agent, ref) for a in args)
        self.logger.warning(
            msg + " (%d similar suppressed)", *args, self.suppressed, extra={**extra, "suppressed": self.suppressed}
        )
        self._last = now
        self.suppressed = 0
        return True
