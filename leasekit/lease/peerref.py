"""How logs and spans name a NIXL peer: a stable short hash of its agent name, never the name itself.

An agent name is whatever a peer calls itself (a claim, not an identity) and a new one appears at every
D restart, so it is neither trusted nor bounded: it never becomes a metric label, and logs and spans carry
:func:`peer_ref` of it instead. The hash is unkeyed SHA-256, so an operator who knows an agent name (from
``leasekit status`` on the D host, say) can compute its reference and find it in P's logs; the reference
reveals nothing an attacker could use, since the name itself proves nothing.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib

REF_PREFIX = "peer-"
REF_HEX_CHARS = 12
"""Hex digits of SHA-256 kept in a reference (48 bits: distinct for every peer a fleet sees)."""
MAX_CACHED = 4096
"""Agent names whose reference :func:`peer_ref` remembers (a peer flooding new names only refills it)."""

_cache: dict[object, str] = {}


def peer_ref(agent: object) -> str:
    """``peer-<12 hex digits>``: the first 48 bits of SHA-256 of ``agent`` (``str``, or ``bytes`` decoded as
    UTF-8 with replacement; anything else through ``str()``). Memoised (at most :data:`MAX_CACHED` names).
    Never raises."""
    ref = _cache.get(agent)
    if ref is not None:
        return ref
    if isinstance(agent, (bytes, bytearray, memoryview)):
        text = bytes(agent).decode("utf-8", "replace")
    else:
        text = str(agent)
    ref = REF_PREFIX + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:REF_HEX_CHARS]
    if len(_cache) >= MAX_CACHED:
        _cache.clear()
    try:
        _cache[agent] = ref
    except TypeError:  # unhashable: not cached
        pass
    return ref
