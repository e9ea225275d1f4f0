"""Lease proofs: the per-lease secret P puts in its grant, and the short tags a LeaseKit D derives from it to
prove, in its heartbeats, completions and hello, that it holds that grant (docs/security.md).

The sender name of a NIXL notification is whatever the sending agent calls itself, and a request id is a
claim anyone can repeat, so P moves a protected lease only on a tag derived from the lease's secret:

- P's engine holds one random key ``K`` (:func:`new_engine_key`, 32 bytes, never sent to a peer; the scheduler
  hands it to its workers through the connector metadata, which stays inside P's processes);
- the lease secret of P request ``r`` is ``T = BLAKE2b-128(key=K, r)`` (:func:`lease_secret`); P's grant (the
  ``kv_transfer_params`` that go back through the router to D) carries it as 32 hex digits
  (:data:`TOKEN_PARAM`), so P keeps no per-lease secret: it derives ``T`` again when it needs it;
- D never sends ``T``. It sends tags ``BLAKE2b-64(key=T, purpose)`` as 16 hex digits: the heartbeat tag
  (:func:`heartbeat_tag`; a heartbeat names ``<r>~<tag>``), the completion tag (:func:`completion_tag`, bound
  to the consumer count: ``<r>~<tag>:<n>``) and the hello tag (:func:`hello_tag`, bound to the verdict inbox's
  endpoint and token). A tag proves ``T`` for ``r`` only: it can never be replayed for another lease.

BLAKE2b in keyed mode is a MAC (RFC 7693 section 2.9, Python's :func:`hashlib.blake2b` ``key=``); it is
several times cheaper here than HMAC-SHA256, which matters on P's engine step. 64-bit tags: a forger must
guess one of 2**64 values per try, each try a counted, dropped notification.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

TOKEN_PARAM = "leasekit_lease_token"
"""Key of the lease secret in the ``kv_transfer_params`` LeaseKit P returns (32 lowercase hex digits)."""

KEY_BYTES = 32
"""Length of P's engine key ``K``, bytes."""
SECRET_BYTES = 16
"""Length of a lease secret ``T``, bytes (sent as :data:`SECRET_HEX_CHARS` hex digits)."""
SECRET_HEX_CHARS = 2 * SECRET_BYTES
TAG_BYTES = 8
"""Length of a tag, bytes (sent as :data:`TAG_HEX_CHARS` hex digits)."""
TAG_HEX_CHARS = 2 * TAG_BYTES
TAG_SEPARATOR = "~"
"""Between a request id and its tag on the wire: ``<request id>~<tag>``."""

_SECRET = re.compile(r"[0-9a-f]{%d}" % SECRET_HEX_CHARS)
_TAG = re.compile(r"[0-9a-f]{%d}" % TAG_HEX_CHARS)
_HEARTBEAT = b"leasekit/heartbeat"
_COMPLETION = b"leasekit/completion:"
_HELLO = b"leasekit/hello:"


def new_engine_key() -> bytes:
    """A new random engine key ``K`` (:data:`KEY_BYTES` bytes from :func:`secrets.token_bytes`)."""
    return secrets.token_bytes(KEY_BYTES)


def lease_secret(key: bytes, req_id: str) -> bytes:
    """``T`` for P request ``req_id`` under engine key ``key``: :data:`SECRET_BYTES` bytes.

    Raises:
        ValueError: ``key`` is not 1..64 bytes (BLAKE2b's key range).
        UnicodeEncodeError: ``req_id`` holds a lone surrogate (not encodable; no vLLM id does).
    """
    return hashlib.blake2b(req_id.encode(), key=key, digest_size=SECRET_BYTES).digest()


def secret_text(secret: bytes) -> str:
    """The grant's form of a lease secret: lowercase hex (:data:`SECRET_HEX_CHARS` digits)."""
    return secret.hex()


def parse_secret(value: object) -> bytes | None:
    """The lease secret from a grant's :data:`TOKEN_PARAM` value, or None when it is not exactly
    :data:`SECRET_HEX_CHARS` lowercase hex digits (a P that minted none, or a garbled grant). Never raises."""
    if type(value) is not str or not _SECRET.fullmatch(value):
        return None
    return bytes.fromhex(value)


def _tag(secret: bytes, purpose: bytes) -> str:
    return hashlib.blake2b(purpose, key=secret, digest_size=TAG_BYTES).hexdigest()


def heartbeat_tag(secret: bytes) -> str:
    """The heartbeat tag of a lease (16 hex digits): D names the lease ``<req_id>~<tag>`` in its heartbeats.
    The same for every heartbeat of the lease (P checks it with one comparison); it proves nothing else."""
    return _tag(secret, _HEARTBEAT)


def completion_tag(secret: bytes, expected_consumers: int) -> str:
    """The completion tag of a lease for consumer count ``expected_consumers`` (16 hex digits): D's read
    completion is ``<req_id>~<tag>:<n>``; a tag for another ``n`` does not verify."""
    return _tag(secret, _COMPLETION + str(int(expected_consumers)).encode())


def hello_tag(secret: bytes, endpoint: str, inbox_token: str) -> str:
    """The hello tag (16 hex digits) over the verdict inbox's ``endpoint`` and ``inbox_token``: a hello naming
    another endpoint or token does not verify."""
    return _tag(secret, _HELLO + f"{endpoint} {inbox_token}".encode())


def split_tagged(wire_id: str) -> tuple[str, str] | None:
    """``(request id, tag)`` of a wire id ``<req_id>~<16 hex digits>``, or None when it has no well-formed
    tag (a plain id). Never raises."""
    req_id, sep, tag = wire_id.rpartition(TAG_SEPARATOR)
    if not sep or not req_id or len(tag) != TAG_HEX_CHARS or not _TAG.fullmatch(tag):
        return None
    return req_id, tag


def tags_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two tags (:func:`hmac.compare_digest`)."""
    return hmac.compare_digest(a.encode(), b.encode())


class LeaseProofs:
    """P's side: derives and checks tags under one engine key (a worker gets the key from the scheduler's
    metadata; until then nothing verifies).

    Args:
        key: the engine key ``K`` (:data:`KEY_BYTES` bytes), or None (not known yet).
    """

    def __init__(self, key: bytes | None = None):
        self.key = key

    def heartbeat_tag(self, req_id: str) -> str | None:
        """The heartbeat tag P expects for ``req_id`` (two BLAKE2b calls), or None without a key."""
        if self.key is None:
            return None
        return heartbeat_tag(lease_secret(self.key, req_id))

    def completion_ok(self, req_id: str, expected_consumers: int, tag: str) -> bool:
        """Whether ``tag`` is ``req_id``'s completion tag for ``expected_consumers``. Never raises."""
        if self.key is None:
            return False
        try:
            return tags_equal(completion_tag(lease_secret(self.key, req_id), expected_consumers), tag)
        except (ValueError, UnicodeEncodeError):
            return False

    def hello_ok(self, req_id: str, endpoint: str, inbox_token: str, tag: str) -> bool:
        """Whether ``tag`` is ``req_id``'s hello tag over ``endpoint`` and ``inbox_token``. Never raises."""
        if self.key is None:
            return False
        try:
            return tags_equal(hello_tag(lease_secret(self.key, req_id), endpoint, inbox_token), tag)
        except (ValueError, UnicodeEncodeError):
            return False
