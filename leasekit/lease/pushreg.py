"""P's checks of push-mode registrations (``PUSH_REG``): what a D's registration must look like, and which
registrations P acts on.

In push mode (vLLM's NixlPushConnector, vllm 0.32.0/0.33.0 ``nixl/push_worker.py``) D sends each P worker a
NIXL notification ``b"PUSH_REG:" + msgpack(registration)`` naming the request, D's engine and side-channel
address and D's KV block ids; P's ``nixl-push-writer`` thread then dials that address and WRITEs the lease's
KV blocks into those ids. Stock P believes every registration: a malformed one raises inside the writer loop
(the rest of that notification batch, heartbeats included, is lost), one that matches no request is kept
forever (``_pending_d_registrations`` grows without bound), and one naming another address makes P connect
there and WRITE the prompt's KV blocks to whoever listens. :class:`PushRegGuard` puts P's rules in front:

- :func:`decode_push_reg` refuses, with a reason, anything but a msgpack map whose fields P uses have the
  types and ranges vLLM writes (``request_id``, ``decode_engine_id``, ``decode_host``, ``decode_port``, ``decode_tp_size``, ``local_block_ids`` naming at least one block)
  within a size ceiling;
- a registration is acted on only for a lease P holds now (its request id, or the same id without vLLM's
  ``-<8 hex>`` suffix, as vLLM matches), only when ``decode_host`` is an allowed address (a side-channel
  peer of P's handshake listener, or ``leasekit_verdict_allow``), and only once per lease;
- one that fails the lease or address rule is held (at most :data:`MAX_HELD` and :data:`MAX_HELD_BYTES`, each at most ``hold_s``
  seconds: the grant or the handshake may reach P's worker a step after D's registration) and dropped
  with its reason when the hold ends.

Pure: no clock (``now`` is passed in), no I/O, no vLLM import; msgpack decoding uses msgspec (vLLM's
own dependency) unless a decoder is passed. Thread-safe: the writer thread filters, the engine thread
tells it of ended leases (:meth:`PushRegGuard.forget`).
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from leasekit.lease.codec import CONTROL_CHARS  # one id rule for every notification
from leasekit.lease.pushend import MAX_ID_CHARS, asked_for_push_end

PUSH_REG_PREFIX = b"PUSH_REG:"
"""vLLM's ``PUSH_REG_NOTIF_PREFIX`` (``nixl/metadata.py``): a registration is this prefix + msgpack."""

MAX_HELD = 1024
"""Registrations held at once waiting for their lease or address (beyond it: ``push_reg_overflow``)."""
MAX_MATCHED = 65536
"""Leases remembered as registered (so a second registration is a repeat) until they end; oldest first."""
MAX_BLOCK_IDS = 1 << 20
"""Block ids one registration may name, all groups together."""
MAX_BLOCK_ID = (1 << 31) - 1
MAX_TP_SIZE = 1024

BAD = "bad_push_reg"
OVERSIZED = "push_reg_oversized"
UNKNOWN_ID = "push_reg_unknown_id"
NOT_ALLOWED = "push_reg_not_allowed"
REPEAT = "push_reg_repeat"
OVERFLOW = "push_reg_overflow"
AMBIGUOUS_ID = "push_reg_ambiguous_id"
LEASE_ENDED = "push_reg_lease_ended"
INTERNAL_ERROR = "internal_error"
DROP_REASONS = (BAD, OVERSIZED, UNKNOWN_ID, NOT_ALLOWED, REPEAT, OVERFLOW, AMBIGUOUS_ID, LEASE_ENDED)
"""Why P dropped a registration (bounded: metric label values): ``bad_push_reg`` (not a msgpack map with the
fields P uses in range), ``push_reg_oversized`` (over the size ceiling), ``push_reg_unknown_id`` (no lease P
holds has its id, within the hold), ``push_reg_not_allowed`` (``decode_host`` is not an allowed address, within
the hold), ``push_reg_repeat`` (the lease already had a registration acted on: a second D rank's, a stranger's
or a replay), ``push_reg_overflow`` (too many held at once), ``push_reg_ambiguous_id`` (its id matches more than one
of P's leases: a client sent one ``X-Request-Id`` twice, and vLLM's writer could WRITE one prompt's KV blocks into
the other's D blocks), ``push_reg_lease_ended`` (its id names a lease P's reap ended before any registration of it
was accepted, within the hold: no WRITE will come; a D that asked for it is told, :mod:`leasekit.lease.pushend`). A failing ``live``/``allowed`` callable drops the
registration as ``internal_error`` (a reason of the notification intake's own)."""

_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*")
LOOPBACK_NAME = "localhost"
"""vLLM's default ``VLLM_NIXL_SIDE_CHANNEL_HOST``: the one host name the guard maps to an address (127.0.0.1)."""
MAX_HELD_BYTES = 16 << 20
"""Bytes of registrations held at once (beyond it: ``push_reg_overflow``)."""


def _is_ip_literal(text: str) -> bool:
    if "%" in text:
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def checked_address(host: str) -> str | None:
    """The IP literal the address rule checks for ``decode_host``: itself, ``127.0.0.1`` for ``localhost``, or
    None for any other host name (P cannot tell where a name leads without resolving it: not allowed)."""
    if _is_ip_literal(host):
        return host
    return "127.0.0.1" if host.lower() == LOOPBACK_NAME else None


@dataclass(frozen=True)
class PushReg:
    """The fields of a registration P acts on.

    Attributes:
        request_id: D's request id (P matches it to its lease: same id, or same id without ``-<8 hex>``).
        decode_engine_id: D's engine id. decode_host: D's side-channel host as vLLM's writer dials it (an IP
        literal or a host name; only IP literals and ``localhost`` can pass the address rule). decode_port: D's side-channel port (1..65535). decode_tp_size: D's TP size (1..1024).
        blocks: how many KV block ids the registration names (all groups; at least 1).
        push_end: D asked for a lease-end notification if the lease ends without a WRITE
            (:mod:`leasekit.lease.pushend`).
    """

    request_id: str
    decode_engine_id: str
    decode_host: str
    decode_port: int
    decode_tp_size: int
    blocks: int
    push_end: bool = False


@dataclass(frozen=True)
class PushRegError:
    """A registration refused: ``reason`` one of :data:`DROP_REASONS`; ``detail`` for logs (never a label)."""

    reason: str
    detail: str


def _msgpack_decode(data: bytes) -> Any:
    import msgspec  # vLLM's dependency; imported here so that leasekit.lease imports without it

    return msgspec.msgpack.decode(data)


def _text(reg: dict, key: str, limit: int) -> str | PushRegError:
    value = reg.get(key)
    if type(value) is not str or not 0 < len(value) <= limit or CONTROL_CHARS.search(value):
        return PushRegError(BAD, f"{key}: must be a string of 1..{limit} characters with no control character")
    return value


def _int(reg: dict, key: str, low: int, high: int) -> int | PushRegError:
    value = reg.get(key)
    if type(value) is not int or not low <= value <= high:
        return PushRegError(BAD, f"{key}: must be an integer in {low}..{high}")
    return value


def _block_count(value: Any) -> int | PushRegError:
    """Count the block ids of ``local_block_ids``: a list of ints, or a list of groups (lists of ints)."""
    if type(value) not in (list, tuple):
        return PushRegError(BAD, "local_block_ids: must be a list of block ids or of groups of block ids")
    groups = value if value and type(value[0]) in (list, tuple) else [value]
    count = 0
    for group in groups:
        if type(group) not in (list, tuple):
            return PushRegError(BAD, "local_block_ids: groups must all be lists")
        count += len(group)
        if count > MAX_BLOCK_IDS:
            return PushRegError(BAD, f"local_block_ids: more than {MAX_BLOCK_IDS} block ids")
        for block in group:
            if type(block) is not int or not 0 <= block <= MAX_BLOCK_ID:
                return PushRegError(BAD, f"local_block_ids: block ids must be integers in 0..{MAX_BLOCK_ID}")
    return count


def decode_push_reg(msg: Any, *, max_bytes: int, decode: Callable[[bytes], Any] = _msgpack_decode
                    ) -> PushReg | PushRegError:
    """Decode one ``PUSH_REG`` notification; never raises.

    Args:
        msg: the raw notification (bytes-like, starting with :data:`PUSH_REG_PREFIX`).
        max_bytes: size ceiling in bytes (checked before decoding).
        decode: msgpack decoder (default msgspec's, as vLLM encodes with).

    Returns:
        :class:`PushReg`, or :class:`PushRegError` (``push_reg_oversized``, else ``bad_push_reg`` naming the
        field and its allowed range).
    """
    if not isinstance(msg, (bytes, bytearray, memoryview)):
        return PushRegError(BAD, f"not bytes: {type(msg).__name__}")
    size = msg.nbytes if isinstance(msg, memoryview) else len(msg)
    if size > max_bytes:
        return PushRegError(OVERSIZED, f"{size} bytes > {max_bytes}")
    data = bytes(msg)
    if not data.startswith(PUSH_REG_PREFIX):
        return PushRegError(BAD, "no PUSH_REG: prefix")
    try:
        reg = decode(data[len(PUSH_REG_PREFIX):])
    except Exception as exc:  # any decoder error: the peer's bytes, not our bug
        return PushRegError(BAD, f"not msgpack: {type(exc).__name__}")
    if type(reg) is not dict:
        return PushRegError(BAD, f"not a map: {type(reg).__name__}")
    fields: list[Any] = [_text(reg, "request_id", MAX_ID_CHARS), _text(reg, "decode_engine_id", MAX_ID_CHARS),
                         _text(reg, "decode_host", 64), _int(reg, "decode_port", 1, 65535),
                         _int(reg, "decode_tp_size", 1, MAX_TP_SIZE), _block_count(reg.get("local_block_ids"))]
    for value in fields:
        if isinstance(value, PushRegError):
            return value
    if not _is_ip_literal(fields[2]) and not _HOSTNAME.fullmatch(fields[2]):
        return PushRegError(BAD, "decode_host: must be an IP address literal (no brackets or zone) or a host name "
                                 "(D's VLLM_NIXL_SIDE_CHANNEL_HOST)")
    if fields[5] == 0:
        return PushRegError(BAD, "local_block_ids: must name at least one block id")
    return PushReg(fields[0], fields[1], fields[2], fields[3], fields[4], fields[5], asked_for_push_end(reg))


@dataclass
class _Held:
    agent: str
    msg: bytes
    reg: PushReg
    until_s: float
    reason: str


AMBIGUOUS = "\x00ambiguous"
"""What ``live`` returns for a request id that matches more than one lease P holds (never a request id: it has a
control character, which :func:`decode_push_reg` refuses in ids)."""


class PushRegGuard:
    """Which registrations P's writer acts on (see the module docstring for the rules).

    Args:
        live: ``live(request_id) -> P's lease id or None``: the lease P holds now for a registration's
            request id (exact, or without vLLM's ``-<8 hex>`` suffix), or :data:`AMBIGUOUS` when that matches more
            than one (dropped at once: ``push_reg_ambiguous_id``); called on the writer thread.
        allowed: ``allowed(host) -> bool``: whether P may dial ``host`` (an IP literal).
        hold_s: seconds a registration failing the lease or address rule is held before it is dropped (>= 0).
        max_bytes: size ceiling of one registration in bytes (> len(prefix)).
        max_held: registrations held at once. decode: msgpack decoder (tests).
        reaped: ``reaped(request_id) -> bool``: whether that id names a lease P's reap ended (expired) before any
            registration of it was accepted; such a registration is held like an unknown one (a new grant under that
            id may still come), then dropped as ``push_reg_lease_ended``, and when it asked for it
            (:attr:`PushReg.push_end`) its sender and id wait in :meth:`take_ended` for a lease-end notification
            (once per sender and id).

    Raises:
        ValueError: ``hold_s`` negative, ``max_bytes`` or ``max_held`` too small.
    """

    def __init__(self, *, live: Callable[[str], str | None], allowed: Callable[[str], bool], hold_s: float,
                 max_bytes: int, max_held: int = MAX_HELD, decode: Callable[[bytes], Any] = _msgpack_decode,
                 reaped: Callable[[str], bool] | None = None):
        if hold_s < 0:
            raise ValueError(f"hold_s={hold_s}: must be >= 0 seconds")
        if max_bytes <= len(PUSH_REG_PREFIX) or max_held < 1:
            raise ValueError(f"max_bytes={max_bytes}, max_held={max_held}: must be > {len(PUSH_REG_PREFIX)} and >= 1")
        self._live, self._allowed, self._decode, self._reaped = live, allowed, decode, reaped
        self._ended: list[tuple[str, str]] = []  # (sender agent, D request id) to tell that the lease ended
        self._told: dict[tuple[str, str], None] = {}  # (sender, D request id) told already, oldest first (bounded)
        self.hold_s, self.max_bytes, self.max_held = float(hold_s), int(max_bytes), int(max_held)
        self._held: list[_Held] = []
        self._held_bytes = 0
        self._matched: dict[str, None] = {}
        self._forgotten: deque[str] = deque()  # engine thread -> writer thread, no lock taken
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Registrations held now."""
        return len(self._held)

    def _tell_ended(self, agent: str, request_id: str) -> None:
        """Queue one lease-end notification for :meth:`take_ended`: once per sender and id (a replayed registration
        costs no second send), at most ``max_held`` waiting."""
        key = (str(agent), request_id)
        if key in self._told or len(self._ended) >= self.max_held:
            return
        self._told[key] = None
        if len(self._told) > MAX_MATCHED:
            del self._told[next(iter(self._told))]
        self._ended.append((agent, request_id))

    def take_ended(self) -> list[tuple[str, str]]:
        """``(sender agent, D request id)`` of the registrations dropped as ``push_reg_lease_ended`` that asked for a
        lease-end notification, since the last call (at most ``max_held`` per call; call it on the thread that calls
        :meth:`filter`)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def forget(self, lease_id: str) -> None:
        """``lease_id``'s lease ended (engine thread; never waits on the writer thread): a later registration for its
        id is unknown, not a repeat. Applied at the next :meth:`filter`."""
        self._forgotten.append(lease_id)

    def filter(self, regs: Iterable[tuple[str, bytes]], now: float
               ) -> tuple[list[tuple[str, bytes, PushReg, str]], list[tuple[str, str, str]]]:
        """Decide this batch's registrations and every held one.

        Args:
            regs: ``(sender agent name, raw PUSH_REG notification)`` in arrival order.
            now: seconds, the clock ``hold_s`` is measured on.

        Returns:
            ``(accepted, dropped)``: ``accepted`` as ``(agent, msg, reg, lease id)`` for P's writer to act on, in
            order (held ones first); ``dropped`` as ``(reason, agent, detail)``. Never raises.
        """
        accepted: list[tuple[str, bytes, PushReg, str]] = []
        dropped: list[tuple[str, str, str]] = []
        decoded: list[tuple[str, bytes, PushReg]] = []
        for agent, msg in regs:  # the costly part, outside the lock
            reg = decode_push_reg(msg, max_bytes=self.max_bytes, decode=self._decode)
            if isinstance(reg, PushRegError):
                dropped.append((reg.reason, agent, reg.detail))
            else:
                decoded.append((agent, bytes(msg), reg))
        with self._lock:
            while self._forgotten:
                self._matched.pop(self._forgotten.popleft(), None)
            held, self._held, self._held_bytes = self._held, [], 0
            for item in held:
                self._safe_decide(item.agent, item.msg, item.reg, now, accepted, dropped, item)
            for agent, msg, reg in decoded:
                self._safe_decide(agent, msg, reg, now, accepted, dropped, None)
        return accepted, dropped

    def _safe_decide(self, agent: str, msg: bytes, reg: PushReg, now: float, accepted: list, dropped: list,
                     held: _Held | None) -> None:
        try:
            self._decide(agent, msg, reg, now, accepted, dropped, held)
        except Exception as exc:  # a failing live()/allowed(): drop this one, keep deciding the others
            dropped.append((INTERNAL_ERROR, agent, f"{type(exc).__name__}: {exc}"))

    def _decide(self, agent: str, msg: bytes, reg: PushReg, now: float, accepted: list, dropped: list,
                held: _Held | None) -> None:
        lease = self._live(reg.request_id)
        if lease == AMBIGUOUS:  # waiting cannot tell which lease D meant: never WRITE one prompt into another's blocks
            dropped.append((AMBIGUOUS_ID, agent, f"request {reg.request_id!r} matches more than one lease (one "
                                                 "X-Request-Id sent twice)"))
            return
        if lease is None and self._reaped is not None and self._reaped(reg.request_id):
            # no WRITE will come for it, unless a new grant under that id reaches P's worker within the hold
            reason, detail = LEASE_ENDED, f"the lease of request {reg.request_id!r} already ended on P"
        elif lease is None:
            reason, detail = UNKNOWN_ID, f"no lease for request {reg.request_id!r}"
        elif (address := checked_address(reg.decode_host)) is None or not self._allowed(address):
            reason, detail = NOT_ALLOWED, (f"decode_host {reg.decode_host} is not an allowed address (a side-channel "
                                           "peer, or leasekit_verdict_allow; a host name other than localhost never "
                                           "is: set D's VLLM_NIXL_SIDE_CHANNEL_HOST to its IP address)")
        elif lease in self._matched:
            dropped.append((REPEAT, agent, f"lease {lease!r} already has a registration"))
            return
        else:
            self._matched[lease] = None
            if len(self._matched) > MAX_MATCHED:
                del self._matched[next(iter(self._matched))]
            accepted.append((agent, msg, reg, lease))
            return
        if held is None:
            if len(self._held) >= self.max_held or self._held_bytes + len(msg) > MAX_HELD_BYTES:
                dropped.append((OVERFLOW, agent, f"{len(self._held)} registrations ({self._held_bytes} bytes) held "
                                f"already (at most {self.max_held}, {MAX_HELD_BYTES} bytes)"))
                return
            held = _Held(agent, msg, reg, now + self.hold_s, reason)
        if now >= held.until_s:
            dropped.append((reason, agent, detail))
            if reason == LEASE_ENDED and reg.push_end:
                self._tell_ended(agent, reg.request_id)
        else:
            held.reason = reason
            self._held.append(held)
            self._held_bytes += len(msg)
