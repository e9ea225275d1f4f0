"""P's reading of large heartbeats, id by id (docs/security.md, "Large heartbeats").

A stock D names every lease it waits on at a P in one heartbeat, ``HB:<id>,<id>...`` (vllm 0.32.0
``nixl/base_worker.py: _send_heartbeats``), so a D waiting on 30 000 leases sends about 1.3 MB in one
notification; :func:`leasekit.lease.codec.decode_notification` refuses a whole message for one bad id and
caps every message at ``leasekit_max_notification_bytes``. :func:`decode_heartbeat_ids` drops only the junk.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from leasekit.lease.codec import (
    CONTROL_CHARS,
    DEFAULT_MAX_BYTES,
    HEARTBEAT_PREFIX,
    MAX_HEARTBEAT_ID_CHARS,
    REASON_EMPTY_ID,
    DecodeError,
    checked_bytes,
    decode_notification,
)


def decode_heartbeat_ids(msg: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[tuple[str, ...], int] | DecodeError:
    """A heartbeat ``HB:<id>,<id>...`` parsed id by id, so that junk costs only itself: ``(the well-formed ids in
    wire order, the number of junk ids)``; an id is junk when it is empty, not UTF-8, holds a control character or
    is over :data:`MAX_HEARTBEAT_ID_CHARS` characters. Never raises.

    Unlike :func:`decode_notification`, which refuses a whole heartbeat for one bad id (and whose ceiling is
    ``leasekit_max_notification_bytes``), P's intake uses this with a ceiling sized to what a real D can send
    (its live leases on P): a stock D names every lease it waits on in one message, and one junk id must not cost
    the others their extension.

    Returns:
        ``(ids, junk)``, or :class:`DecodeError` ``oversized`` (``len(msg) > max_bytes``), ``not_bytes``, or,
        when no id at all is well-formed, the reason :func:`leasekit.lease.codec.decode_notification` gives
        (``not_utf8``, ``empty_id``, ``bad_id``).
    """
    msg = checked_bytes(msg, max_bytes)
    if isinstance(msg, DecodeError):
        return msg
    body = bytes(msg[len(HEARTBEAT_PREFIX):])
    try:
        text = body.decode("utf-8")
        parts = text.split(",")
        clean = CONTROL_CHARS.search(text) is None
    except UnicodeDecodeError:
        parts, clean = body.split(b","), False
    if clean and all(0 < len(part) <= MAX_HEARTBEAT_ID_CHARS for part in parts):
        return tuple(parts), 0
    ids: list[str] = []
    for part in parts:
        if isinstance(part, bytes):
            try:
                part = part.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if 0 < len(part) <= MAX_HEARTBEAT_ID_CHARS and not CONTROL_CHARS.search(part):
            ids.append(part)
    if not ids:  # the whole message is junk: refused for the reason the strict codec gives
        whole = decode_notification(msg, max_bytes=max_bytes)
        if isinstance(whole, DecodeError):
            return whole
        return DecodeError(REASON_EMPTY_ID, f"heartbeat: none of its {len(parts)} ids is well-formed")
    return tuple(ids), len(parts) - len(ids)
