"""LeaseKitConnector's own ``kv_connector_extra_config`` keys: reading, checking and linting them.

Pure (no vLLM import), so that ``leasekit lint`` refuses exactly what the connector refuses at start.
Each reader takes vLLM's ``KVTransferConfig`` (``get_from_extra_config``) or a plain mapping, applies
the default when the key is unset, and raises a ``ValueError`` subclass whose message names the field,
the value, the allowed range and the fix. The connector calls them in ``__init__`` (a bad value stops
the engine at start); :func:`lint_leasekit_keys` turns them into lint findings.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from typing import Any

from leasekit.lease.codec import DEFAULT_MAX_BYTES

DEFAULT_MAX_HOLD_S = 480.0
"""Default hard cap on one lease's total life, seconds (vLLM's old ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``)."""

MAX_HOLD_EXTRA_KEY = "leasekit_max_hold_s"
MAX_BYTES_EXTRA_KEY = "leasekit_max_notification_bytes"
MAX_BYTES_LIMIT = 64 << 20


class NotificationConfigError(ValueError):
    """``leasekit_max_hold_s`` or ``leasekit_max_notification_bytes`` is out of range (message: field,
    value, allowed range, fix)."""


def notification_settings(extra_config: Any, lease_duration_s: float) -> tuple[float, int]:
    """Read and check ``(max_hold_s, max_notification_bytes)`` from ``kv_connector_extra_config``
    (:func:`max_hold_seconds`, then :func:`max_notification_bytes`).

    Args:
        extra_config: vLLM's ``KVTransferConfig`` (``get_from_extra_config``) or a plain mapping.
        lease_duration_s: ``L`` in seconds; the cap must be at least ``L`` (unset: ``max(480, L)``).

    Raises:
        NotificationConfigError: max hold not a number in ``[L, max(L, 86400)]`` seconds, or max bytes not
            an integer in ``[1024, 64 MiB]`` (the first of the two found).
    """
    return max_hold_seconds(extra_config, lease_duration_s), max_notification_bytes(extra_config)


def max_hold_seconds(extra_config: Any, lease_duration_s: float) -> float:
    """``leasekit_max_hold_s`` in seconds (unset: ``max(480, L)``). Raises NotificationConfigError: not a
    number in ``[L, max(L, 86400)]``."""
    max_hold = _getter(extra_config)(MAX_HOLD_EXTRA_KEY, None)
    if max_hold is None:
        max_hold = max(DEFAULT_MAX_HOLD_S, float(lease_duration_s))
    high = max(86400.0, float(lease_duration_s))
    if isinstance(max_hold, bool) or not isinstance(max_hold, (int, float)) or not lease_duration_s <= max_hold <= high:
        raise NotificationConfigError(
            f"kv_connector_extra_config.{MAX_HOLD_EXTRA_KEY}={max_hold!r}: must be seconds in "
            f"[kv_lease_duration={lease_duration_s:g}, {high:g}]; fix: leave it unset (max(480, kv_lease_duration)) "
            f"or set it within that range"
        )
    return float(max_hold)


def max_notification_bytes(extra_config: Any) -> int:
    """``leasekit_max_notification_bytes`` (unset: 1 MiB). Raises NotificationConfigError: not an integer
    in ``[1024, 64 MiB]``."""
    max_bytes = _getter(extra_config)(MAX_BYTES_EXTRA_KEY, DEFAULT_MAX_BYTES)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not 1024 <= max_bytes <= MAX_BYTES_LIMIT:
        raise NotificationConfigError(
            f"kv_connector_extra_config.{MAX_BYTES_EXTRA_KEY}={max_bytes!r}: must be an integer number of "
            f"bytes in [1024, {MAX_BYTES_LIMIT}]; fix: leave it unset ({DEFAULT_MAX_BYTES})"
        )
    return max_bytes


VERDICT_TIMEOUT_EXTRA_KEY = "leasekit_verdict_timeout_s"
VERDICT_TIMEOUT_RANGE_S = (0.05, 86400.0)
DEFAULT_VERDICT_TIMEOUT_CAP_S = 600.0


class ReadGateConfigError(ValueError):
    """``leasekit_verdict_timeout_s`` is out of range (message: field, value, allowed range, fix)."""


def verdict_timeout(extra_config: Any, lease_duration_s: float) -> float:
    """Seconds D waits for P's verdicts on one read: ``kv_connector_extra_config.leasekit_verdict_timeout_s``,
    default ``min(L, 600)`` (at least 0.05; while P holds leases its loop handles notifications at least
    every ``L``, or they expire anyway).

    Raises:
        ReadGateConfigError: not a number of seconds in ``[0.05, 86400]``.
    """
    get = _getter(extra_config)
    low, high = VERDICT_TIMEOUT_RANGE_S
    value = get(VERDICT_TIMEOUT_EXTRA_KEY, None)
    if value is None:  # the default, clamped into range (a tiny L is linted elsewhere, not refused here)
        return min(max(float(lease_duration_s), low), DEFAULT_VERDICT_TIMEOUT_CAP_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ReadGateConfigError(
            f"kv_connector_extra_config.{VERDICT_TIMEOUT_EXTRA_KEY}={value!r}: must be seconds in [{low:g}, {high:g}]; "
            f"fix: leave it unset (min(kv_lease_duration, {DEFAULT_VERDICT_TIMEOUT_CAP_S:g}) s)"
        )
    return float(value)


FAIL_CLOSED_EXTRA_KEY = "leasekit_fail_closed"


def fail_closed_enabled(extra_config: Any) -> bool:
    """Whether P speaks the fail-closed protocol: ``kv_connector_extra_config.leasekit_fail_closed``
    (bool, default True; docs/fail-closed.md). False makes P a stock P on the wire: it marks no request,
    ignores hellos and never sends a D anything (its verdicts and acks travel over ZMQ, never NIXL).

    Raises:
        ReadGateConfigError: not a bool.
    """
    get = _getter(extra_config)
    value = get(FAIL_CLOSED_EXTRA_KEY, True)
    if not isinstance(value, bool):
        raise ReadGateConfigError(
            f"kv_connector_extra_config.{FAIL_CLOSED_EXTRA_KEY}={value!r}: must be true or false; fix: a JSON "
            "boolean, or leave it unset (true)"
        )
    return value


PLEDGE_EXTRA_KEY = "leasekit_pledge_s"
DEFAULT_PLEDGE_S = 1.0


def pledge_seconds(extra_config: Any, lease_duration_s: float) -> float:
    """Seconds after a grant before which P frees none of its blocks, whatever completions arrive (the
    grant pledge, leasekit/lease/pledge.py): ``kv_connector_extra_config.leasekit_pledge_s``, default
    ``min(1, L)``; 0 turns the pledge off (every read right after a grant then waits for an ack or a
    verdict). Costs P: a lease whose read finished earlier keeps its blocks pinned until then.

    Raises:
        ReadGateConfigError: not a number of seconds in ``[0, L]``.
    """
    get = _getter(extra_config)
    value = get(PLEDGE_EXTRA_KEY, None)
    if value is None:
        return min(DEFAULT_PLEDGE_S, float(lease_duration_s))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= lease_duration_s:
        raise ReadGateConfigError(
            f"kv_connector_extra_config.{PLEDGE_EXTRA_KEY}={value!r}: must be seconds in "
            f"[0, kv_lease_duration={lease_duration_s:g}]; fix: leave it unset (min({DEFAULT_PLEDGE_S:g}, "
            "kv_lease_duration)), or 0 to turn the pledge off"
        )
    return float(value)


VERDICT_ALLOW_EXTRA_KEY = "leasekit_verdict_allow"
MAX_VERDICT_NETWORKS = 64


def verdict_allow(extra_config: Any) -> tuple:
    """Networks P's verdict channel may connect to (docs/security.md):
    ``kv_connector_extra_config.leasekit_verdict_allow``, a list of CIDR strings (``["10.0.0.0/8",
    "fd00::/8"]``; a bare address is a /32 or /128). Unset or empty: ``()``, and P allows only the addresses
    its side-channel handshake listener served (the D workers that fetched its NIXL metadata).

    Returns:
        a tuple of :class:`ipaddress.IPv4Network` / :class:`ipaddress.IPv6Network`.

    Raises:
        ReadGateConfigError: not a list of at most 64 CIDR strings (the message names the bad entry).
    """
    get = _getter(extra_config)
    value = get(VERDICT_ALLOW_EXTRA_KEY, None)
    if value is None:
        return ()
    fix = 'a JSON list of CIDR strings such as ["10.0.0.0/8"], or leave it unset (the side-channel peers)'
    if not isinstance(value, (list, tuple)) or len(value) > MAX_VERDICT_NETWORKS:
        raise ReadGateConfigError(
            f"kv_connector_extra_config.{VERDICT_ALLOW_EXTRA_KEY}={value!r}: must be a list of at most "
            f"{MAX_VERDICT_NETWORKS} CIDR strings; fix: {fix}")
    networks = []
    for entry in value:
        try:
            if not isinstance(entry, str):
                raise ValueError("not a string")
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError as exc:
            raise ReadGateConfigError(
                f"kv_connector_extra_config.{VERDICT_ALLOW_EXTRA_KEY}={value!r}: entry {entry!r} is not a CIDR "
                f"network ({exc}); fix: {fix}") from None
    return tuple(networks)


RUN_DIR_EXTRA_KEY = "leasekit_run_dir"

ROLE_OF_KEY = {
    MAX_HOLD_EXTRA_KEY: "kv_producer",
    MAX_BYTES_EXTRA_KEY: None,  # both roles parse the NIXL notifications they receive (P answers D over ZMQ)
    FAIL_CLOSED_EXTRA_KEY: "kv_producer",
    PLEDGE_EXTRA_KEY: "kv_producer",
    VERDICT_ALLOW_EXTRA_KEY: "kv_producer",
    VERDICT_TIMEOUT_EXTRA_KEY: "kv_consumer",
    RUN_DIR_EXTRA_KEY: None,
}
"""Every LeaseKit extra-config key -> the only role it has an effect on (None: both); the connector range-
checks every key on every role at start."""


def _getter(extra_config: Any):
    return getattr(extra_config, "get_from_extra_config", None) or (lambda k, d: extra_config.get(k, d))


def lint_leasekit_keys(extra: Mapping, role: object, lease_duration_s: float | None, field_prefix: str) -> list[tuple[str, str, str, str]]:
    """Lint the ``leasekit_*`` keys of one ``kv_connector_extra_config`` mapping ``extra`` for ``role``
    (``kv_producer``, ``kv_consumer``, ``kv_both`` or anything else: not role-checked) and lease
    duration ``L`` in seconds (None: unusable, range checks needing it are skipped).

    Returns:
        ``(field, severity, message, fix)`` tuples, ``field`` prefixed with ``field_prefix``: an
        out-of-range value (error, exactly what the connector refuses at start), an unknown
        ``leasekit_*`` key (warning, with the closest known key), a key the role ignores (warning).
    """
    found: list[tuple[str, str, str, str]] = []
    checks = [lambda: fail_closed_enabled(extra), lambda: max_notification_bytes(extra), lambda: verdict_allow(extra)]
    if lease_duration_s is not None:
        checks += [lambda: max_hold_seconds(extra, lease_duration_s),
                   lambda: verdict_timeout(extra, lease_duration_s),
                   lambda: pledge_seconds(extra, lease_duration_s)]
    for check in checks:
        try:
            check()
        except (NotificationConfigError, ReadGateConfigError) as exc:
            message, _, fix = str(exc).partition("; fix: ")
            field = message.split("=", 1)[0].removeprefix("kv_connector_extra_config.")
            found.append((f"{field_prefix}.{field}", "error", message, fix or "leave it unset"))
    for key in extra:
        if not isinstance(key, str) or not key.startswith("leasekit_"):
            continue
        if key not in ROLE_OF_KEY:
            close = difflib.get_close_matches(key, ROLE_OF_KEY, n=1)
            found.append((f"{field_prefix}.{key}", "warning", f"{key} is not a LeaseKitConnector key: it is ignored",
                           f"did you mean {close[0]}?" if close else f"use one of {', '.join(sorted(ROLE_OF_KEY))}"))
        elif (ROLE_OF_KEY[key] is not None and role in ("kv_producer", "kv_consumer") and role != ROLE_OF_KEY[key]
              and not any(f[0] == f"{field_prefix}.{key}" for f in found)):  # an out-of-range value says enough
            side = "P (kv_producer)" if ROLE_OF_KEY[key] == "kv_producer" else "D (kv_consumer)"
            found.append((f"{field_prefix}.{key}", "warning",
                          f"{key} has an effect only on {side}: on {role} it is only range-checked at start",
                          f"set it in the {side} config"))
    return found
