"""Lease config: timing derived from ``kv_lease_duration`` exactly as vLLM derives it, parsing and lint.

Source: vllm 0.32.0 ``distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``
(``self._heartbeat_interval = self._kv_lease_duration // 6``) and ``base_worker.py``
(``self._lease_extension = kv_lease_duration * 2 // 3``). Python floor division is kept as is:
an int ``L`` gives int ``H`` and ``E``; a float ``L`` gives float ``H`` and ``E`` (``7.5 // 6 == 1.0``).
:class:`LeaseConfig` and :func:`lint_kv_transfer_config` read the ``--kv-transfer-config`` JSON as
vLLM does (``kv_connector_extra_config.get(key, default)``, ``vllm/config/kv_transfer.py``).
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from leasekit.lease.clock import KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S as _TURN2_MARGIN_S
from leasekit.lease.settings import lint_leasekit_keys

DEFAULT_LEASE_DURATION_S = 30
"""vLLM's default ``kv_lease_duration`` in seconds (``get_from_extra_config(..., 30)``)."""

DEFAULT_DECODER_KV_BLOCKS_TTL_S = 480
"""vLLM's default ``decoder_kv_blocks_ttl`` in seconds (``nixl/base_scheduler.py``): how long D keeps
blocks cached for a turn-2 readback (bidirectional mode), with no heartbeat."""

MAX_LEASE_DURATION_S = 3600
"""The longest ``kv_lease_duration`` (seconds) leasekit accepts, as the scenario schema's ``[lease]
duration_s`` and the pair file's ``lease_duration_s`` do: a dead D would hold P's KV blocks that long,
and far beyond it the derived ``E = L * 2 // 3`` overflows to inf/nan."""

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
"""The ``kv_role`` values vLLM accepts (``vllm/config/kv_transfer.py: KVRole``)."""


@dataclass(frozen=True)
class LintFinding:
    """One problem found in a lease config.

    Attributes:
        field: dotted path of the offending setting, e.g. ``kv_connector_extra_config.kv_lease_duration``
            (``kv_transfer_config`` for the document as a whole).
        severity: ``"error"`` (vLLM refuses or crashes, or the lease cannot work) or ``"warning"``.
        message: what is wrong and what it does to the lease.
        fix: what to set instead.
    """

    field: str
    severity: Literal["error", "warning"]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}; fix: {self.fix}"


class LeaseConfigError(ValueError):
    """A lease setting is outside the range the mechanism can work with.

    The message names the field, the value, the allowed range and the fix.
    """


def _check_duration(lease_duration_s: object) -> float | int:
    if isinstance(lease_duration_s, bool) or not isinstance(lease_duration_s, (int, float)):
        raise LeaseConfigError(
            f"kv_lease_duration must be a number of seconds, got {lease_duration_s!r} "
            f"({type(lease_duration_s).__name__}); fix: pass e.g. 30"
        )
    if (isinstance(lease_duration_s, float) and not math.isfinite(lease_duration_s)) or lease_duration_s <= 0:
        raise LeaseConfigError(
            f"kv_lease_duration must be a finite number of seconds > 0, got {lease_duration_s!r}; "
            "fix: pass e.g. 30 (vLLM's default)"
        )
    return lease_duration_s


def lint_timing_findings(timing: "LeaseTiming", *, field: str = "kv_lease_duration") -> list[LintFinding]:
    """Findings for the config edges of docs/lease-model.md ("Bounds"), each with its fix; [] when clean.

    - ``E == 0`` (``L < 2``), error: heartbeats extend nothing; every lease expires at ``grant + L``.
    - ``0 < E <= H``, error: a lease can expire between two delivered heartbeats.
    - ``H == 0`` (``L < 6``), warning: D heartbeats every engine step.

    ``field`` is the name the findings carry (e.g. ``kv_connector_extra_config.kv_lease_duration``).
    Sources: vllm ``nixl/base_scheduler.py`` (``H = L // 6``), ``nixl/base_worker.py`` (``E = L * 2 // 3``).
    """
    L, H, E = timing.lease_duration_s, timing.heartbeat_interval_s, timing.extension_s
    fix = "kv_lease_duration >= 6"
    findings = []
    if E <= 0:
        findings.append(LintFinding(field, "error", (
            f"kv_lease_duration={L} < 2 gives extension E={E}: heartbeats do nothing and every lease "
            "expires at grant + L even while D is healthy"), fix))
    elif E <= H:
        findings.append(LintFinding(field, "error", (
            f"extension E={E} <= heartbeat interval H={H}: leases can expire between heartbeats"), fix))
    if H <= 0:
        findings.append(LintFinding(field, "warning", (
            f"kv_lease_duration={L} < 6 gives heartbeat interval H={H}: D sends a heartbeat batch every "
            "engine step"), fix))
    return findings


def lint_timing(timing: "LeaseTiming") -> list[str]:
    """:func:`lint_timing_findings` as ``"<message>; fix: <fix>"`` strings; [] when clean."""
    return [str(finding) for finding in lint_timing_findings(timing)]


@dataclass(frozen=True)
class LeaseTiming:
    """The three lease numbers, all in seconds.

    Attributes:
        lease_duration_s: ``L``, the lease P grants at the end of a prefill (``kv_lease_duration``).
        heartbeat_interval_s: ``H = L // 6``, how often D sends one heartbeat batch per P engine.
        extension_s: ``E = L * 2 // 3``; each delivered heartbeat sets
            ``expiry = max(expiry, now + E)`` on P.

    Build it with :meth:`from_lease_duration`; the constructor does not re-derive ``H`` and ``E``.
    """

    lease_duration_s: float
    heartbeat_interval_s: float
    extension_s: float

    @classmethod
    def from_lease_duration(cls, lease_duration_s: float) -> "LeaseTiming":
        """Derive ``H`` and ``E`` from ``L`` (seconds) with vLLM's integer/float floor division.

        Raises:
            LeaseConfigError: ``L`` is not a finite number > 0 (bool and str are refused).
        """
        L = _check_duration(lease_duration_s)
        return cls(lease_duration_s=L, heartbeat_interval_s=L // 6, extension_s=L * 2 // 3)


_ROOT = "kv_transfer_config"
_EXTRA = "kv_connector_extra_config"
_SECONDS_FIELDS = {
    "kv_lease_duration": (DEFAULT_LEASE_DURATION_S, "P frees every lease at its next step, before D can read"),
    "decoder_kv_blocks_ttl": (DEFAULT_DECODER_KV_BLOCKS_TTL_S, "D frees its cached blocks at once: no turn-2 readback"),
}


def _load(config: object) -> tuple[Mapping | None, LintFinding | None]:
    """The config document (its extra config checked to be a mapping), or the finding that stops parsing."""
    fix = 'pass a JSON object, e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}\''
    doc = config
    if isinstance(config, (str, bytes, bytearray)):
        try:
            doc = json.loads(config)
        except (ValueError, RecursionError) as exc:
            return None, LintFinding(_ROOT, "error", f"{_ROOT} is not valid JSON ({exc})", fix)
    if not isinstance(doc, Mapping):
        return None, LintFinding(_ROOT, "error", f"{_ROOT} must be a JSON object, got {type(doc).__name__}", fix)
    extra = doc.get(_EXTRA, {})
    if not isinstance(extra, Mapping):
        return None, LintFinding(
            _EXTRA, "error", f"{_EXTRA} must be a JSON object, got {type(extra).__name__}",
            f'"{_EXTRA}": {{"kv_lease_duration": {DEFAULT_LEASE_DURATION_S}}} (or leave it out)')
    return doc, None


def _seconds_finding(name: str, value: object) -> LintFinding | None:
    """The error for an extra-config value vLLM cannot use as seconds (missing keys are defaulted)."""
    default, at_zero = _SECONDS_FIELDS[name]
    field, fix = f"{_EXTRA}.{name}", f"set a whole number of seconds > 0, e.g. {default} (vLLM's default)"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return LintFinding(field, "error", f"{name}={shown} ({type(value).__name__}) is not a number of "
                           "seconds: vLLM fails on it at startup or at the first request", fix)
    if isinstance(value, float) and not math.isfinite(value):  # an int is finite (math.isfinite overflows on 10**400)
        return LintFinding(field, "error", f"{name}={value!r} is not finite: deadlines derived from it "
                           "are never reached, so the blocks are never freed", fix)
    if value <= 0:
        return LintFinding(field, "error", f"{name}={value!r} <= 0: {at_zero}", fix)
    if name == "kv_lease_duration" and value > MAX_LEASE_DURATION_S:
        return LintFinding(field, "error", f"{name}={shown} is out of range: leasekit accepts 0 < L <= "
                           f"{MAX_LEASE_DURATION_S} s (a dead D would hold P's KV blocks for L)",
                           f"set a whole number of seconds in (0, {MAX_LEASE_DURATION_S}], e.g. {default} (vLLM's default)")
    return None


_NIXL_EXTRA_KEYS = (*_SECONDS_FIELDS, "bidirectional_kv_xfer", "backends")
"""``kv_connector_extra_config`` keys NixlConnector reads (besides LeaseKitConnector's ``leasekit_*``)."""


def _misspelt_keys(extra: Mapping) -> list[LintFinding]:
    """A warning for each key that is not one NixlConnector reads but is close to one (a typo: vLLM
    ignores it and uses the default), naming the closest known key."""
    found = []
    for key in extra:
        if not isinstance(key, str) or key.startswith("leasekit_") or key in _NIXL_EXTRA_KEYS:
            continue
        close = difflib.get_close_matches(key, _NIXL_EXTRA_KEYS, n=1, cutoff=0.8)
        if close:
            default = _SECONDS_FIELDS.get(close[0], (None,))[0]
            found.append(LintFinding(f"{_EXTRA}.{key}", "warning", f"{key} is not a key NixlConnector reads: it is "
                                     f"ignored{f' and {close[0]} stays at its default {default}' if default is not None else ''}",
                                     f"did you mean {close[0]}?"))
    return found


def _extra_seconds(doc: Mapping, name: str) -> object:
    # vLLM: kv_connector_extra_config.get(key, default); an explicit null is None, not the default.
    return doc.get(_EXTRA, {}).get(name, _SECONDS_FIELDS[name][0])


STOCK_CONNECTORS = ("NixlConnector", "NixlPushConnector")
"""vLLM's NIXL connectors (pull and push), whose lease leasekit observes."""
LEASEKIT_CONNECTORS = ("LeaseKitConnector", "LeaseKitPushConnector")
"""LeaseKit's connectors, loaded from :data:`CONNECTOR_MODULE`."""
CONNECTOR_MODULE = "leasekit.vllm.connector"
"""The ``kv_connector_module_path`` vLLM imports LeaseKit's connectors from."""


def _connector_findings(doc: dict) -> list[LintFinding]:
    """``kv_connector`` and ``kv_connector_module_path``: a connector that is not a NIXL one (warning: no lease),
    a LeaseKit connector vLLM cannot load (no or another module path: error), ``leasekit_*`` keys that a stock
    connector ignores (warning). vLLM loads a connector named in ``kv_connector_module_path`` by importing it
    (vllm 0.32.0 ``distributed/kv_transfer/kv_connector/factory.py``)."""
    name, module = doc.get("kv_connector"), doc.get("kv_connector_module_path")
    known = STOCK_CONNECTORS + LEASEKIT_CONNECTORS
    findings = []
    if name is not None and name not in known:  # absent: a partial config, linted for its lease only
        findings.append(LintFinding("kv_connector", "warning", f"kv_connector={name!r} is not a NIXL connector: "
                                    "it has no KV lease, so nothing here applies", f"one of {', '.join(known)}"))
    elif name in LEASEKIT_CONNECTORS and module != CONNECTOR_MODULE:
        what = "is missing" if module is None else f"is {module!r}"
        findings.append(LintFinding("kv_connector_module_path", "error",
                                    f"kv_connector_module_path {what}: vLLM cannot load {name} (it is not built in)",
                                    f'"kv_connector_module_path": "{CONNECTOR_MODULE}"'))
    extra = doc.get(_EXTRA)
    if name in STOCK_CONNECTORS and isinstance(extra, dict):
        ignored = sorted(k for k in extra if isinstance(k, str) and k.startswith("leasekit_"))
        if ignored:
            findings.append(LintFinding(f"{_EXTRA}.{ignored[0]}", "warning",
                                        f"{', '.join(ignored)} set on vLLM's {name}, which ignores them",
                                        f'use "kv_connector": "LeaseKit{name.removeprefix("Nixl")}" with '
                                        f'"kv_connector_module_path": "{CONNECTOR_MODULE}", or remove them'))
    return findings


def _lint(config: object) -> list[LintFinding]:
    doc, stop = _load(config)
    if stop is not None:
        return [stop]
    role, findings = doc.get("kv_role"), []
    role_fix = "set kv_role to kv_producer on P (prefill) and kv_consumer on D (decode)"
    if role is None or role not in KV_ROLES:
        what = "is missing: vLLM refuses a kv_connector without one" if role is None else f"is not one of {KV_ROLES}"
        findings.append(LintFinding("kv_role", "error", f"kv_role={role!r} {what}", role_fix))
    elif role == "kv_both":
        findings.append(LintFinding("kv_role", "warning", "kv_role='kv_both' is deprecated for NixlConnector", role_fix))
    L, ttl = (_extra_seconds(doc, name) for name in _SECONDS_FIELDS)
    bad_l, bad_ttl = (_seconds_finding(name, v) for name, v in zip(_SECONDS_FIELDS, (L, ttl)))
    if bad_l is not None:
        findings.append(bad_l)
    else:
        timing = LeaseTiming.from_lease_duration(L)
        if isinstance(L, float):
            findings.append(LintFinding(
                f"{_EXTRA}.kv_lease_duration", "warning",
                f"kv_lease_duration={L!r} is a float: vLLM's floor division gives float "
                f"H={timing.heartbeat_interval_s!r} and E={timing.extension_s!r}",
                f"use a whole number of seconds, e.g. {max(6, round(L))}"))
        findings += lint_timing_findings(timing, field=f"{_EXTRA}.kv_lease_duration")
    if bad_ttl is not None:
        findings.append(bad_ttl)
    elif ttl <= _TURN2_MARGIN_S:
        findings.append(LintFinding(
            f"{_EXTRA}.decoder_kv_blocks_ttl", "warning",
            f"decoder_kv_blocks_ttl={ttl!r} <= P's {_TURN2_MARGIN_S} s safety margin: with "
            "bidirectional_kv_xfer P declines every turn-2 read", f"set it well above {_TURN2_MARGIN_S}, e.g. 480"))
    findings += _connector_findings(doc)
    extra = doc.get(_EXTRA, {})
    findings += _misspelt_keys(extra)
    findings += [LintFinding(f, sev, msg, fix) for f, sev, msg, fix in
                 lint_leasekit_keys(extra, role, L if bad_l is None else None, _EXTRA)]
    if (role == "kv_consumer" and doc.get("kv_connector") == "LeaseKitConnector"
            and doc.get("kv_load_failure_policy", "fail") != "recompute"):
        findings.append(LintFinding(
            "kv_load_failure_policy", "warning",
            f"kv_load_failure_policy={doc.get('kv_load_failure_policy', 'fail')!r} (vLLM's default 'fail'): a read a "
            "fail-closed LeaseKit D discards (its lease expired) fails the request with an error instead of "
            "recomputing it", '"kv_load_failure_policy": "recompute" on D'))
    return findings


def lint_kv_transfer_config(config: str | Mapping) -> list[LintFinding]:
    """Lint the JSON users pass to vLLM's ``--kv-transfer-config`` (or its parsed mapping); never raises.

    Findings, each naming its field and fix: invalid JSON or a non-object; ``kv_role`` missing or
    unknown (error; allowed :data:`KV_ROLES`) or ``kv_both`` (warning: deprecated,
    ``nixl/connector.py``); ``kv_connector_extra_config.kv_lease_duration`` and ``.decoder_kv_blocks_ttl``
    non-numeric (bool and null included), nan, inf, or <= 0, and a lease duration above
    :data:`MAX_LEASE_DURATION_S` (errors); a misspelt extra-config key (warning naming the closest key
    NixlConnector reads); a float lease duration
    (warning); the timing edges of :func:`lint_timing_findings`; a ``decoder_kv_blocks_ttl`` within
    the 5 s turn-2 margin (``nixl/pull_worker.py``, warning); LeaseKitConnector's ``leasekit_*`` keys
    (:func:`leasekit.lease.settings.lint_leasekit_keys`: out of range as the connector refuses it at start,
    unknown, or set on a role that ignores it); on D, a ``kv_load_failure_policy`` other than
    ``recompute`` (warning: a read the fail-closed gate discards then fails the request); the connector
    (:func:`_connector_findings`: not a NIXL one, a LeaseKit one vLLM cannot load, ``leasekit_*`` keys on a stock
    one). Missing values take vLLM's defaults.

    Returns:
        The findings (document, ``kv_role``, lease duration, TTL, connector, ``leasekit_*`` keys, failure policy,
        in that order); [] when clean.
    """
    try:
        return _lint(config)
    except Exception as exc:  # a user Mapping may raise anything; linting must not
        return [LintFinding(_ROOT, "error", f"{_ROOT} could not be read: {type(exc).__name__}: {exc}",
                            "pass a JSON string or a plain dict")]


@dataclass(frozen=True)
class LeaseConfig:
    """The lease settings of one vLLM server, as its NixlConnector reads them.

    Attributes:
        timing: ``L``, ``H``, ``E`` from ``kv_connector_extra_config.kv_lease_duration`` (default 30 s).
        decoder_kv_blocks_ttl_s: TTL in seconds of blocks D caches for a turn-2 readback
            (``kv_connector_extra_config.decoder_kv_blocks_ttl``, default 480; ``nixl/base_scheduler.py``).
        source: a copy of the whole parsed ``--kv-transfer-config`` (excluded from ``==`` and hash).
    """

    timing: LeaseTiming
    decoder_kv_blocks_ttl_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL_S
    source: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_kv_transfer_config(cls, config: str | Mapping) -> "LeaseConfig":
        """Parse ``--kv-transfer-config`` JSON (or its mapping) as vLLM does; missing values default.

        Only what the lease needs is checked here (``kv_role`` is not: use
        :func:`lint_kv_transfer_config` for every finding).

        Raises:
            LeaseConfigError: naming the field, for invalid JSON, a non-object document or extra
                config, or a ``kv_lease_duration``/``decoder_kv_blocks_ttl`` that is not a finite
                number > 0 (bool and null are not numbers), or a ``kv_lease_duration`` above
                :data:`MAX_LEASE_DURATION_S`.
        """
        doc, stop = _load(config)
        if stop is not None:
            raise LeaseConfigError(f"{stop.field}: {stop}")
        values = {name: _extra_seconds(doc, name) for name in _SECONDS_FIELDS}
        for name, value in values.items():
            bad = _seconds_finding(name, value)
            if bad is not None:
                raise LeaseConfigError(f"{bad.field}: {bad}")
        return cls(LeaseTiming.from_lease_duration(values["kv_lease_duration"]),
                   values["decoder_kv_blocks_ttl"], copy.deepcopy(dict(doc)))
