"""Push mode: P telling a LeaseKit D that the lease of a request D registered has ended without a WRITE.

In push mode D allocates the request's KV blocks, sends P a ``PUSH_REG`` and waits for P's WRITE. When P reclaimed
that lease first (its expiry, e.g. while its writer thread was stalled for longer than E), the WRITE never comes:
vLLM's D waits until its client gives up, and a request aborted while it waits for a WRITE keeps its blocks until
the WRITE lands (vllm 0.32.0 ``scheduler.py`` ``finish_requests``), so they stay allocated for ever (the D-side leak
of https://github.com/vllm-project/vllm/issues/46283). LeaseKit's P, which never WRITEs from a reclaimed lease,
sends D a lease-end notification instead; D fails that request's load through vLLM's own path
(``_failed_recv_reqs``), so vLLM recomputes it (``kv_load_failure_policy``) or, for an aborted request, frees its
blocks.

Wire: ``LKEND:`` + D's request id (UTF-8), one NIXL notification per D agent. Only a D that asked for it receives
one: LeaseKit's D adds ``"leasekit_push_end": 1`` to its ``PUSH_REG`` map when exactly one P rank writes the request
(P TP <= D TP, P PP 1: one lease-end then means no WRITE at all). vLLM's P reads the keys it knows and ignores
others (``push_worker.py`` ``_handle_push_reg_notif``); vLLM's D would misread one (``push_worker.py``
``_get_new_notifs`` splits every other notification as ``<request id>:<TP size>``, logs an error and counts it as a
notification after expiry).
"""

from __future__ import annotations

from dataclasses import dataclass

from leasekit.lease.codec import CONTROL_CHARS

PUSH_END_PREFIX = b"LKEND:"
"""Prefix of a lease-end notification (P to D, push mode)."""
OPT_IN_KEY = "leasekit_push_end"
"""The ``PUSH_REG`` key (value 1) by which a D asks P for lease-end notifications."""
MAX_ID_CHARS = 1024
"""Longest request id a registration or a lease-end notification may name (characters); an id must also hold no
control character (:data:`leasekit.lease.codec.CONTROL_CHARS`)."""


@dataclass(frozen=True)
class PushEndError:
    """A lease-end notification D could not read: ``reason`` ``bad_id`` (a metric label value), ``detail`` for logs."""

    reason: str
    detail: str


def encode_push_end(d_request_id: str) -> bytes:
    """The lease-end notification for D's request ``d_request_id``.

    Raises:
        ValueError: the id is empty, longer than :data:`MAX_ID_CHARS` characters, or has a control character.
    """
    if not isinstance(d_request_id, str) or not 0 < len(d_request_id) <= MAX_ID_CHARS or CONTROL_CHARS.search(d_request_id):
        raise ValueError(f"d_request_id: a request id of 1..{MAX_ID_CHARS} characters without control characters, "
                         f"got {d_request_id!r:.80}")
    return PUSH_END_PREFIX + d_request_id.encode()


def is_push_end(msg: object) -> bool:
    """Whether ``msg`` (a raw NIXL notification) is a lease-end notification."""
    return isinstance(msg, (bytes, bytearray)) and bytes(msg[:len(PUSH_END_PREFIX)]) == PUSH_END_PREFIX


def decode_push_end(msg: bytes | bytearray) -> str | PushEndError:
    """D's request id named by a lease-end notification, or :class:`PushEndError` (``bad_id``). Never raises."""
    body = bytes(msg[len(PUSH_END_PREFIX):])
    if not 0 < len(body) <= 4 * MAX_ID_CHARS:
        return PushEndError("bad_id", f"lease-end notification of {len(body)} id bytes (1..{4 * MAX_ID_CHARS})")
    try:
        rid = body.decode()
    except UnicodeDecodeError:
        return PushEndError("bad_id", "lease-end notification id is not UTF-8")
    if len(rid) > MAX_ID_CHARS or CONTROL_CHARS.search(rid):
        return PushEndError("bad_id", f"lease-end notification id {rid!r:.80} has control characters or is too long")
    return rid


def asked_for_push_end(reg: object) -> bool:
    """Whether a decoded ``PUSH_REG`` map asked for lease-end notifications (``"leasekit_push_end": 1``)."""
    return type(reg) is dict and reg.get(OPT_IN_KEY) == 1 and type(reg.get(OPT_IN_KEY)) is int
