"""The vLLM release a started P/D pair actually runs, read from its servers, for the conformance matrix.

vLLM's OpenAI server answers ``GET /version`` with ``{"version": vllm.__version__}``
(``vllm/entrypoints/serve/instrumentator/basic.py``). After P and D are healthy the pair reads it from
each (at most 3 s in all and 64 KiB per read) and keeps the release on the pair object
(:attr:`leasekit.cluster.pair.PDPair.vllm_release`); when D restarts, only the new D is read, and an
unreadable answer keeps the release known before. The suite gives each result the pair's release as it
stands when the scenario ends, so the matrix shows what ran, not what a pair file claims.

Representation (one string per pair, what ``report.json``, JUnit and the terminal table show):

* P and D report the same release: that release, ``"0.32.0"``;
* they differ (a mixed pair; vLLM refuses the NIXL handshake between two releases, see
  :mod:`leasekit.lease.releases`, so its warm-up is expected to fail): both, ``"P 0.33.0 / D 0.32.0"``;
* a server whose ``/version`` cannot be read (no whole answer within 3 s, not HTTP 200, a body over
  64 KiB, not JSON, no version string): ``"unknown"`` for that side (``"unknown"`` when both are). An unreadable version never fails a run.

The release is the public part of the version: a local part is dropped (``"0.32.0+cpu"`` ->
``"0.32.0"``, :func:`leasekit.lease.releases.release_of`), as the pair file's ``vllm_release`` is written.

A pair file's optional ``vllm_release`` (:attr:`leasekit.cluster.pairfile.PairFile.vllm_release`) is the
release the run must test: a server that reports another one stops the pair start with
:class:`VllmReleaseMismatch`; a server whose release is unknown is not refused.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import httpx

from leasekit.cluster.pairfile import LOCAL, PairFileError
from leasekit.lease.releases import pair_release_problems, release_of

logger = logging.getLogger(__name__)

UNKNOWN_RELEASE = "unknown"
"""The release of a server whose ``/version`` could not be read (and of a result no pair ran for)."""

VERSION_TIMEOUT_S = 3.0
"""Seconds one ``GET /version`` may take in all, connection to last body byte (the server is already
healthy: it answers in milliseconds)."""

VERSION_MAX_BYTES = 64 * 1024
"""The largest ``/version`` body read (vLLM's is about 25 bytes); a larger one is unknown."""

ROLES = ("prefill", "decode")

_REPORTED = re.compile(r"[0-9][0-9A-Za-z.!+_-]{0,63}")
"""What a reported ``vllm.__version__`` may look like (PEP 440 characters, at most 64); anything else is unknown."""


class VllmReleaseMismatch(PairFileError):
    """A started server reports another vLLM release than the pair file's ``vllm_release``.

    Attributes:
        declared: the pair file's ``vllm_release``.
        measured: ``{"prefill": release, "decode": release}`` as read from ``/version``.
        vllm_release: the pair's release label (:func:`pair_label`), for the report of the failed start.
    """

    def __init__(self, message: str, declared: str, measured: dict[str, str]):
        super().__init__(message)
        self.declared = declared
        self.measured = dict(measured)
        self.vllm_release = pair_label(measured.get("prefill", UNKNOWN_RELEASE), measured.get("decode", UNKNOWN_RELEASE))


def read_release(url: str, timeout_s: float = VERSION_TIMEOUT_S, max_bytes: int = VERSION_MAX_BYTES) -> str:
    """The release of the vLLM server at ``url`` (base URL, e.g. ``http://127.0.0.1:8100``) from one
    ``GET <url>/version``, local part dropped (``"0.32.0+cpu"`` -> ``"0.32.0"``).

    ``timeout_s`` bounds the whole read, not each phase (httpx's timeouts are per connect, per read: a
    server trickling its body a byte at a time would never trip them): the read runs on a daemon thread
    and the caller waits at most ``timeout_s`` seconds; that thread stops at the first body chunk after the
    deadline or when one read waits ``timeout_s`` seconds. The body is streamed and at most ``max_bytes``
    bytes are kept.

    Returns :data:`UNKNOWN_RELEASE` when the whole answer does not arrive within ``timeout_s`` seconds, is
    other than HTTP 200, content-encoded, over ``max_bytes`` bytes, not a JSON object, or has a ``version``
    that is not a version string. Never raises.
    """
    deadline = time.monotonic() + timeout_s
    answer: list[str] = []
    reader = threading.Thread(target=lambda: answer.append(_read_version(url, deadline, timeout_s, max_bytes)),
                              name="leasekit-vllm-version", daemon=True)
    reader.start()
    reader.join(timeout_s)
    return answer[0] if answer else UNKNOWN_RELEASE


def _read_version(url: str, deadline: float, timeout_s: float, max_bytes: int) -> str:
    """The body of :func:`read_release` (``deadline`` on ``time.monotonic()``); never raises."""
    body = bytearray()
    try:
        with httpx.stream("GET", f"{url.rstrip('/')}/version", timeout=timeout_s,
                          headers={"Accept-Encoding": "identity"}) as response:
            length = response.headers.get("content-length", "0")
            if (response.status_code != 200 or response.headers.get("content-encoding", "identity") != "identity"
                    or (length.isdigit() and int(length) > max_bytes)):
                return UNKNOWN_RELEASE
            for chunk in response.iter_raw():
                body += chunk
                if len(body) > max_bytes or time.monotonic() > deadline:
                    return UNKNOWN_RELEASE
        data = json.loads(bytes(body))
    except Exception as exc:  # noqa: BLE001 - an unreadable version never fails a run
        logger.debug("GET %s/version: %s: %s", url, type(exc).__name__, exc)
        return UNKNOWN_RELEASE
    version = data.get("version") if isinstance(data, dict) else None
    if not isinstance(version, str) or not _REPORTED.fullmatch(version.strip()):
        return UNKNOWN_RELEASE
    return release_of(version)


def pair_label(prefill: str, decode: str) -> str:
    """One string for the releases P and D report: ``"0.32.0"`` when equal, else ``"P 0.33.0 / D 0.32.0"``
    (either side may be :data:`UNKNOWN_RELEASE`)."""
    return prefill if prefill == decode else f"P {prefill} / D {decode}"


def declared_problems(declared: str | None, measured: dict[str, str], where: dict[str, str]) -> list[str]:
    """Why the measured releases contradict the pair file's ``vllm_release`` (empty when they do not, when
    nothing is declared, or for a side whose release is unknown).

    Args:
        declared: the pair file's ``vllm_release`` (None: not set).
        measured: ``{"prefill": release, "decode": release}`` from :func:`read_release`.
        where: ``{"role": "<the interpreter and the pair-file field that sets it>"}`` for the fix.
    """
    if declared is None:
        return []
    out = []
    for role, side in (("prefill", "P"), ("decode", "D")):
        release = measured.get(role, UNKNOWN_RELEASE)
        if release in (UNKNOWN_RELEASE, declared):
            continue
        out.append(f"vllm_release: the pair file declares vLLM {declared}, but {side} ({role}) reports vLLM {release} "
                   f"on GET /version; fix: point {where.get(role, 'its python')} at an interpreter that has vLLM "
                   f"{declared} (`python -c \"import vllm; print(vllm.__version__)\"` prints {declared}), or set "
                   f"vllm_release = \"{release}\" if that is the release you meant to test")
    return out


def _interpreter(deployment, role: str) -> str:
    """The interpreter ``role`` runs under and the pair-file field that sets it, for a fix."""
    return f"python in [hosts.{deployment.role(role).host or LOCAL}] (now {deployment.python(role)})"


def measure_pair(pair, roles: tuple[str, ...] = ROLES) -> tuple[dict[str, str], str]:
    """Read the release of ``pair``'s started servers named in ``roles`` (a
    :class:`leasekit.cluster.pair.PDPair`: ``prefill.url``, ``decode.url``, ``deployment``, and
    ``vllm_releases`` from an earlier read) and hold both against its pair file's ``vllm_release``.

    ``roles``: both at a pair start; ``("decode",)`` after D restarts (P is the same process). A side not
    read, or read as unknown, keeps the release in ``pair.vllm_releases`` (a known release is never
    replaced by unknown).

    Returns ``({"prefill": release, "decode": release}, label)`` (:func:`pair_label`). A mixed pair is
    logged at WARNING (vLLM refuses the NIXL handshake between releases: its warm-up will say so).

    Raises:
        VllmReleaseMismatch: the pair file sets ``vllm_release`` and a server reports another release
            (the message names the field, both values and the fix).
    """
    measured = {role: (getattr(pair, "vllm_releases", None) or {}).get(role, UNKNOWN_RELEASE) for role in ROLES}
    for role in roles:
        release = read_release(getattr(pair, role).url)
        if release != UNKNOWN_RELEASE:
            measured[role] = release
    deployment = getattr(pair, "deployment", None)
    declared = getattr(deployment, "vllm_release", None)
    where = {role: _interpreter(deployment, role) for role in measured} if deployment is not None else {}
    problems = declared_problems(declared, measured, where)
    if problems:
        raise VllmReleaseMismatch("pair start refused:\n  " + "\n  ".join(problems), declared, measured)
    known = [r for r in measured.values() if r != UNKNOWN_RELEASE]
    if len(known) == 2 and known[0] != known[1]:
        for _, problem, fix in pair_release_problems(*known, require_supported=False):
            logger.warning("%s; fix: %s", problem, fix)
    return measured, pair_label(measured["prefill"], measured["decode"])
