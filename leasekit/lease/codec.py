"""NIXL notification codecs, byte-identical to vLLM's NixlConnector (vllm 0.32.0).

D sends two kinds of NIXL notification to P:

- heartbeat: ``("HB:" + ",".join(remote_req_ids)).encode()``
  (``nixl/base_worker.py: _send_heartbeats``), one per remote P engine per interval ``H``;
- read completion: ``f"{remote_request_id}:{expected_consumers}".encode()``
  (``nixl/pull_worker.py: _read_blocks``), one per consumer rank.

Stock P decodes them with ``notif.decode("utf-8")``, ``msg.startswith("HB:")`` and ``req_id, n = msg.rsplit(":", 1)``
/ ``int(n)`` (``nixl/pull_worker.py: _get_new_notifs``), so non-UTF-8 bytes, a message with no ``:`` and a
non-integer count each raise inside P's engine step. :func:`decode_notification` keeps vLLM's semantics for every
well-formed message (``startswith("HB:")`` first, then ``rsplit(":", 1)``) and returns a :class:`DecodeError` for
everything else: it never raises.

LeaseKit peers speak a small protocol on top (``LK1:``; docs/fail-closed.md), used only between peers
that discovered each other: P marks the ``kv_transfer_params`` it returns with
``"leasekit_protocol": 2``; a LeaseKit D that sees the marker sends P the heartbeat ``HB:LK1~H~<base64
endpoint and token>`` (the ZMQ endpoint of its verdict inbox, so that P can answer it without a NIXL connection back;
a stock P ignores heartbeat ids it does not hold, so even a wrongly marked request cannot crash it) and
then waits, per read, for P's ``LK1:V:ok:<id>`` or ``LK1:V:reaped:<id>`` on that inbox. A stock D never
receives an ``LK1:`` message. Version 1 (verdicts as NIXL notifications) is not spoken: each side treats the
other version's requests as a stock peer's (unprotected, counted).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from leasekit.lease.pledge import CLOCK_ID_PATTERN

HEARTBEAT_PREFIX = "HB:"
"""A notification starting with this is a heartbeat (vLLM tests ``startswith`` before anything)."""

DEFAULT_MAX_BYTES = 1 << 20
"""Default ceiling on a notification's size in bytes, checked before decoding."""

MAX_EXPECTED_CONSUMERS = 1_000_000
"""Largest consumer count accepted in a completion (vLLM's is the number of D ranks reading)."""

MAX_HEARTBEAT_ID_CHARS = 1024
"""Longest request id accepted inside a heartbeat, in characters."""

REASON_OVERSIZED = "oversized"
REASON_NOT_UTF8 = "not_utf8"
REASON_EMPTY = "empty"
REASON_NO_COLON = "no_colon"
REASON_BAD_COUNT = "bad_count"
REASON_EMPTY_ID = "empty_id"
REASON_BAD_ID = "bad_id"
REASON_NOT_BYTES = "not_bytes"
REASON_BAD_PROTOCOL = "bad_protocol"
DECODE_ERROR_REASONS = (
    REASON_OVERSIZED,
    REASON_NOT_UTF8,
    REASON_EMPTY,
    REASON_NO_COLON,
    REASON_BAD_COUNT,
    REASON_EMPTY_ID,
    REASON_BAD_ID,
    REASON_NOT_BYTES,
    REASON_BAD_PROTOCOL,
)
"""Every :attr:`DecodeError.reason`; a closed set, fit for a metric label."""

PROTOCOL_PREFIX = "LK1:"
"""Prefix of LeaseKit protocol notifications (version 1). A vLLM request id never starts with it in
practice (vLLM's ids are ``cmpl-``/``chatcmpl-`` plus random hex); one that did would be read as a
protocol message and dropped as ``bad_protocol``."""
PROTOCOL_PARAM = "leasekit_protocol"
"""Key LeaseKit P adds to the ``kv_transfer_params`` it returns (value :data:`PROTOCOL_VERSION`); stock D
ignores unknown keys (vllm 0.32.0 ``nixl/pull_scheduler.py`` reads with ``params.get``)."""
PROTOCOL_VERSION = 4
"""4: the grant carries a lease secret (:data:`leasekit.lease.proof.TOKEN_PARAM`) and D proves it with tags in its
heartbeats (``<id>~<tag>``), completions (``<id>~<tag>:<n>``) and hello (:mod:`leasekit.lease.proof`);
3: acknowledgements carry P's clock reading and clock id, and grants a pledge (leasekit/lease/pledge.py);
2: P -> D verdicts and acknowledgements over ZMQ (leasekit/vllm/verdictchan.py); 1 sent them as NIXL
notifications over a UCX connection P opened back to D."""
D_ACCEPTED_VERSIONS = (2, 3, 4)
"""Markers LeaseKit D protects: a version-2 or -3 P (a rolling upgrade) gets plain ids and a hello without a lease
proof (a version-2 P acks without a clock, decoded as such; its reads wait for verdicts or acks, no pledge). Any other marker is
treated as a stock P's (unprotected, counted)."""
HELLO_TOKEN_PREFIX = "LK1~H~"
"""A heartbeat id ``LK1~H~<base64 "<endpoint> <token>">`` is D's hello: the ZMQ endpoint ``tcp://<IP>:<port>`` of
that D worker's verdict inbox and the token its messages must carry (leasekit/vllm/verdictchan.py; base64
holds no ``,``)."""
VERDICT_PREFIX = PROTOCOL_PREFIX + "V:"
ACK_PREFIX = PROTOCOL_PREFIX + "A:"
SEQUENCE_TOKEN_PREFIX = "LK1~"
"""A LeaseKit D appends ``LK1~<n>`` as one more id to each heartbeat it sends a LeaseKit P (stock P ignores
ids it does not hold, vllm 0.32.0 ``base_worker.py`` ``_handle_heartbeat``); P echoes ``n`` in its ack."""
VERDICT_OK = "ok"
VERDICT_REAPED = "reaped"

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Characters no peer-supplied id may hold (Unicode Cc: C0, DEL, C1): they would forge log lines or framing."""
_DIGITS = re.compile(r"[0-9]{1,16}")
_CLOCK_ID = re.compile(r"-|" + CLOCK_ID_PATTERN)  # ASCII only: int() would also take " 3", "+3", "3_0", "٣"


@dataclass(frozen=True)
class Heartbeat:
    """A decoded heartbeat: the P-side request ids whose leases D asks P to extend, in wire order.

    Duplicates are kept (vLLM's handler extends each id it meets; a repeat is a no-op).
    """

    req_ids: tuple[str, ...]


@dataclass(frozen=True)
class Completion:
    """A decoded read completion: one consumer rank finished reading ``req_id``'s blocks.

    P frees the blocks once it has counted ``expected_consumers`` completions for ``req_id``.
    """

    req_id: str
    expected_consumers: int


@dataclass(frozen=True)
class DecodeError:
    """A notification :func:`decode_notification` refused.

    Attributes:
        reason: one of :data:`DECODE_ERROR_REASONS` (bounded cardinality: use it as a label).
        detail: human-readable detail, possibly quoting (a truncated repr of) the input; never a label.
    """

    reason: str
    detail: str


@dataclass(frozen=True)
class Verdict:
    """``LK1:V:ok|reaped:<id>``: P's answer to one read completion of ``req_id`` (P's request id).

    ``ok`` is True when the lease was still live when P handled the completion: P frees blocks only in
    the engine loop that handles notifications, so the blocks were P's KV for the whole read."""

    req_id: str
    ok: bool


@dataclass(frozen=True)
class Ack:
    """``LK1:A:<seq>:<remaining_ms>:<p_now_us>:<clock_id>:<id>,<id>...``: P handled D's heartbeat number
    ``seq`` (the ``LK1~<seq>`` token D added to it) and every listed lease (P's request ids; possibly none)
    was live with at least ``remaining_s`` seconds to its deadline, counted from P's clock read after the
    heartbeat had arrived (after ``get_new_notifs`` returned), before handling it. ``remote_now_s`` is that
    reading (P's ``perf_counter``, seconds, rounded up to the microsecond on the wire, plus one microsecond
    when decoded) and ``clock_id`` names P's clock
    (None when P could not name it: ``-`` on the wire).
    D, which began sending that heartbeat at ``s`` on its own clock, then knows each lease is held until
    at least ``s + remaining_s`` (no cross-host clock comparison), and has one sample of P's clock for the
    grant pledge (leasekit/lease/pledge.py)."""

    seq: int
    remaining_s: float
    req_ids: tuple[str, ...]
    remote_now_s: float = 0.0
    clock_id: str | None = None


Notification = Heartbeat | Completion | Verdict | Ack | DecodeError


def encode_hello(payload: bytes) -> bytes:
    """The hello heartbeat ``HB:LK1~H~<base64 payload>``: ``payload`` is ``<endpoint> <token>`` (ASCII), the
    ZMQ endpoint of the sending D worker's verdict inbox and its token
    (:func:`leasekit.vllm.verdictchan.encode_hello_payload`; ``tcp://10.0.0.7:41234 0123456789abcdef``).

    Raises:
        ValueError: the encoded id would exceed :data:`MAX_HEARTBEAT_ID_CHARS`.
    """
    token = HELLO_TOKEN_PREFIX + base64.b64encode(bytes(payload)).decode()
    if len(token) > MAX_HEARTBEAT_ID_CHARS:
        raise ValueError(f"a hello payload of {len(payload)} bytes is too large for a heartbeat id")
    return (HEARTBEAT_PREFIX + token).encode()


def encode_verdict(req_id: str, ok: bool) -> bytes:
    """``LK1:V:ok:<req_id>`` or ``LK1:V:reaped:<req_id>`` (the id last: it may hold ``:``)."""
    return f"{VERDICT_PREFIX}{VERDICT_OK if ok else VERDICT_REAPED}:{req_id}".encode()


def encode_ack(seq: int, remaining_s: float, req_ids: Iterable[str], remote_now_s: float = 0.0,
               clock_id: str | None = None) -> bytes:
    """``LK1:A:<seq>:<remaining ms, rounded down>:<P now in us, rounded up>:<clock id or ->:<ids comma-joined>``.
    ``remote_now_s``: P's ``perf_counter`` seconds (>= 0); ``clock_id``: :func:`leasekit.vllm.clockid.local_clock_id`."""
    now_us = max(0, math.ceil(remote_now_s * 1e6))
    return f"{ACK_PREFIX}{int(seq)}:{max(0, int(remaining_s * 1000))}:{now_us}:{clock_id or '-'}:{','.join(req_ids)}".encode()


def sequence_token(seq: int) -> str:
    """The heartbeat id D appends for heartbeat number ``seq``: ``LK1~<seq>``."""
    return f"{SEQUENCE_TOKEN_PREFIX}{int(seq)}"


def split_protocol_ids(req_ids: Iterable[str]) -> tuple[int | None, bytes | None, tuple[str, ...]]:
    """``(seq, hello endpoint bytes, the other ids)`` of a heartbeat's ids: ``seq`` from a valid ``LK1~<n>``,
    the hello's decoded payload from a valid ``LK1~H~<base64>`` (None when absent or not base64)."""
    seq, hello, rest = None, None, []
    for req_id in req_ids:
        if req_id.startswith(HELLO_TOKEN_PREFIX):
            try:
                hello = base64.b64decode(req_id[len(HELLO_TOKEN_PREFIX):], validate=True) or None
            except (binascii.Error, ValueError):
                rest.append(req_id)
            continue
        tail = req_id[len(SEQUENCE_TOKEN_PREFIX):] if req_id.startswith(SEQUENCE_TOKEN_PREFIX) else None
        if tail is not None and _DIGITS.fullmatch(tail):
            seq = int(tail)
        else:
            rest.append(req_id)
    return seq, hello, tuple(rest)


def _decode_protocol(text: str) -> Notification:
    if text.startswith(VERDICT_PREFIX):
        verdict, sep, req_id = text[len(VERDICT_PREFIX):].partition(":")
        if not sep or verdict not in (VERDICT_OK, VERDICT_REAPED):
            return DecodeError(REASON_BAD_PROTOCOL, f"verdict is not ok|reaped:<id>: {_short(text)}")
        problem = _id_problem(req_id, max_chars=None)
        if problem is not None:
            return DecodeError(problem.reason, f"verdict: {problem.detail}")
        return Verdict(req_id, verdict == VERDICT_OK)
    if text.startswith(ACK_PREFIX):
        parts = text[len(ACK_PREFIX):].split(":", 4)
        if (len(parts) != 5 or not _DIGITS.fullmatch(parts[0]) or not _DIGITS.fullmatch(parts[1])
                or not _DIGITS.fullmatch(parts[2]) or not _CLOCK_ID.fullmatch(parts[3])):
            old = text[len(ACK_PREFIX):].split(":", 2)  # version 2 (no clock): a P not upgraded yet
            if len(old) != 3 or not _DIGITS.fullmatch(old[0]) or not _DIGITS.fullmatch(old[1]):
                return DecodeError(REASON_BAD_PROTOCOL, f"ack is not <seq>:<ms>:<us>:<clock>:<ids>: {_short(text)}")
            parts = [old[0], old[1], "", "-", old[2]]
        ids = tuple(parts[4].split(",")) if parts[4] else ()
        for req_id in ids:
            problem = _id_problem(req_id, max_chars=MAX_HEARTBEAT_ID_CHARS)
            if problem is not None:
                return DecodeError(problem.reason, f"ack: {problem.detail}")
        clock = None if parts[3] == "-" else parts[3]
        now_s = (int(parts[2]) + 1) / 1e6 if clock is not None else 0.0  # +1 us: never rounded down
        return Ack(int(parts[0]), int(parts[1]) / 1000.0, ids, now_s, clock)
    return DecodeError(REASON_BAD_PROTOCOL, f"unknown LeaseKit protocol message: {_short(text)}")


def encode_heartbeat(remote_req_ids: Iterable[str]) -> bytes:
    """Encode a heartbeat exactly as vLLM does: ``("HB:" + ",".join(ids)).encode()``.

    Source: vllm ``nixl/base_worker.py: _send_heartbeats``. The given order is kept (vLLM iterates
    a ``set``, so its wire order is arbitrary). Ids are not validated, as in vLLM; an id holding
    ``,`` cannot round-trip.

    Raises:
        TypeError: ``remote_req_ids`` is a single ``str``/``bytes`` (it would be split per character).
    """
    if isinstance(remote_req_ids, (str, bytes, bytearray)):
        raise TypeError("encode_heartbeat takes an iterable of request ids, not a single string")
    return (HEARTBEAT_PREFIX + ",".join(remote_req_ids)).encode()


def encode_completion(remote_req_id: str, expected_consumers: int) -> bytes:
    """Encode a read completion exactly as vLLM does: ``f"{req_id}:{n}".encode()``.

    Source: vllm ``nixl/pull_worker.py: _read_blocks``. Not validated, as in vLLM.
    """
    return f"{remote_req_id}:{expected_consumers}".encode()


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _id_problem(req_id: str, *, max_chars: int | None) -> DecodeError | None:
    if not req_id:
        return DecodeError(REASON_EMPTY_ID, "empty request id")
    if CONTROL_CHARS.search(req_id):
        return DecodeError(REASON_BAD_ID, f"request id holds a control character: {_short(req_id)}")
    if max_chars is not None and len(req_id) > max_chars:
        return DecodeError(REASON_BAD_ID, f"request id is {len(req_id)} chars, over {max_chars}")
    return None


def checked_bytes(msg: object, max_bytes: int) -> bytes | bytearray | DecodeError:
    """``msg`` as bytes (a ``memoryview`` copied), or :class:`DecodeError` ``not_bytes`` (not bytes-like) or
    ``oversized`` (``len(msg) > max_bytes``), checked before any decoding. Never raises."""
    if isinstance(msg, memoryview):
        msg = msg.tobytes()
    if not isinstance(msg, (bytes, bytearray)):
        return DecodeError(REASON_NOT_BYTES, f"expected bytes, got {type(msg).__name__}")
    if len(msg) > max_bytes:
        return DecodeError(REASON_OVERSIZED, f"{len(msg)} bytes > max_bytes={max_bytes}")
    return msg


def decode_notification(msg: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Notification:
    """Decode one NIXL notification; never raises.

    Checks, in order: size (``len(msg) > max_bytes`` is ``oversized``, before any decoding), strict
    UTF-8 (``not_utf8``), emptiness (``empty``); then, as vLLM, a message starting with ``HB:`` is a
    heartbeat (its ids split on ``,``; ``HB:`` alone or ``HB:a,,b`` is ``empty_id``; an id with a
    control character or over 1024 chars is ``bad_id``); anything else is a completion split with
    ``rsplit(":", 1)`` (``a:b:2`` is ``Completion("a:b", 2)``; no ``:`` is ``no_colon``; an
    empty id is ``empty_id``; a control character in it ``bad_id``; a count that is not ASCII
    base-10 digits in ``1..1_000_000`` is ``bad_count``).

    Stricter than vLLM (``nixl/pull_worker.py: _get_new_notifs``), which raises on the first three
    kinds of bad input and, through ``int()``, accepts counts such as ``" 2"``, ``"+2"``, ``"2_0"``,
    ``"0"`` and ``"-1"`` (a count < 1 is never reached, so the blocks are held until expiry).

    Args:
        msg: the raw notification (``bytes``; ``bytearray`` and ``memoryview`` are accepted).
        max_bytes: size ceiling in bytes.

    Returns:
        :class:`Heartbeat` (D's hello and sequence token are heartbeat ids: :func:`split_protocol_ids`),
        :class:`Completion`, :class:`Verdict` or :class:`Ack` (after an ``LK1:`` prefix: a malformed one
        is ``bad_protocol``) or :class:`DecodeError` (``not_bytes`` for input that is not bytes-like).
    """
    msg = checked_bytes(msg, max_bytes)
    if isinstance(msg, DecodeError):
        return msg
    try:
        text = bytes(msg).decode("utf-8")
    except UnicodeDecodeError as exc:
        return DecodeError(REASON_NOT_UTF8, f"{exc.reason} at byte {exc.start}: {_short(bytes(msg[:40]))}")
    if not text:
        return DecodeError(REASON_EMPTY, "empty notification")
    if text.startswith(PROTOCOL_PREFIX):
        return _decode_protocol(text)
    if text.startswith(HEARTBEAT_PREFIX):
        ids = tuple(text[len(HEARTBEAT_PREFIX) :].split(","))
        for req_id in ids:
            problem = _id_problem(req_id, max_chars=MAX_HEARTBEAT_ID_CHARS)
            if problem is not None:
                return DecodeError(problem.reason, f"heartbeat: {problem.detail}")
        return Heartbeat(ids)
    if ":" not in text:
        return DecodeError(REASON_NO_COLON, f"not a heartbeat and no ':' separator: {_short(text)}")
    req_id, count = text.rsplit(":", 1)
    if not _DIGITS.fullmatch(count) or not 1 <= int(count) <= MAX_EXPECTED_CONSUMERS:
        return DecodeError(
            REASON_BAD_COUNT, f"consumer count {_short(count)} is not an integer in 1..{MAX_EXPECTED_CONSUMERS}"
        )
    problem = _id_problem(req_id, max_chars=None)
    if problem is not None:
        return DecodeError(problem.reason, f"completion: {problem.detail}")
    return Completion(req_id, int(count))


class NotificationCounters:
    """Counts of decoded notifications by kind and of refusals by reason. Pure; not thread-safe.

    ``as_dict()`` shape: ``{"heartbeat": int, "completion": int, "error": {reason: int}}`` with every
    reason of :data:`DECODE_ERROR_REASONS` present (zeros included), plus ``"heartbeat_ids": int``,
    the total number of request ids carried by heartbeats, and ``"protocol": int``, LeaseKit verdicts
    and acknowledgements.
    """

    def __init__(self) -> None:
        self.heartbeats = 0
        self.completions = 0
        self.heartbeat_ids = 0
        self.protocol = 0
        self.errors: dict[str, int] = dict.fromkeys(DECODE_ERROR_REASONS, 0)

    def record(self, result: Notification) -> None:
        """Count one :func:`decode_notification` result.

        Raises:
            TypeError: ``result`` is not a Heartbeat, Completion or DecodeError.
        """
        if isinstance(result, Heartbeat):
            self.heartbeats += 1
            self.heartbeat_ids += len(result.req_ids)
        elif isinstance(result, Completion):
            self.completions += 1
        elif isinstance(result, (Verdict, Ack)):
            self.protocol += 1
        elif isinstance(result, DecodeError):
            self.errors[result.reason] = self.errors.get(result.reason, 0) + 1
        else:
            raise TypeError(f"not a decode_notification result: {type(result).__name__}")

    def as_dict(self) -> dict:
        """A snapshot (a new dict; later ``record`` calls do not change it)."""
        return {
            "heartbeat": self.heartbeats,
            "completion": self.completions,
            "heartbeat_ids": self.heartbeat_ids,
            "protocol": self.protocol,
            "error": dict(self.errors),
        }
