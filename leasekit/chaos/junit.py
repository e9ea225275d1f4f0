"""Chaos verdicts as a JUnit XML report, for CI (Jenkins ``junit``, GitLab ``artifacts:reports:junit``).

The layout is the de facto JUnit schema both read (Ant's ``JUnitResultFormatter`` output, the XSD
Jenkins' junit plugin validates against; GitLab's "Unit test reports" doc): ``<testsuites>`` >
``<testsuite name tests failures errors skipped time timestamp hostname>`` > ``<testcase
classname name time>``, with at most one ``<failure>``, ``<error>`` or ``<skipped>`` child and a
``<system-out>``. Mapping of leasekit verdicts (Jepsen's valid / invalid / unknown):

* PASS -> a plain ``<testcase>``;
* FAIL -> ``<failure message=... type="FAIL">`` (the bound was violated);
* UNKNOWN -> ``<skipped message=...>`` (the fault did not exercise the bound: no evidence either way);
* anything else (a harness error, a malformed verdict) -> ``<error message=... type=...>``, so a
  broken run never reads as green.

``system-out`` carries the bound, the measured value, the reason and the evidence text.
"""

from __future__ import annotations

import math
import re
import socket
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from leasekit.chaos import FAIL, PASS, UNKNOWN

_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
"""Characters XML 1.0 cannot carry, even escaped (ElementTree would write them and the file would
not parse). ANSI colour codes from server logs are the usual source."""

MESSAGE_MAX_CHARS = 1000
"""``message`` attributes are cut to this length (CI tools show them inline); the full text is in
``system-out``."""


@dataclass(frozen=True)
class JUnitCase:
    """One scenario run against one target.

    Attributes:
        name: the scenario name (``testcase/@name``), e.g. ``kill-decode``.
        target: the system under test (``testcase/@classname``), e.g. ``leasekit`` or ``stock``;
            dots make Jenkins group by package.
        verdict: ``PASS``, ``FAIL`` or ``UNKNOWN`` (``leasekit.chaos.VERDICTS``); anything else is
            reported as an ``<error>``.
        duration_s: wall time of the run in seconds (``testcase/@time``); negative or non-finite
            values are written as 0.
        bound: the bound the run was held to (a number of seconds or a formula), or None.
        measured: the measured value (seconds or text), or None.
        reason: one line: why this verdict.
        evidence: free text (per-lease table, log excerpts) for ``system-out``.
        properties: ``name -> value`` written as ``testcase/properties/property`` (the conformance matrix's other
            axes, e.g. ``transfer_mode`` = ``pull``/``push``), sorted by name; empty values are left out.
    """

    name: str
    target: str
    verdict: str
    duration_s: float = 0.0
    bound: float | str | None = None
    measured: float | str | None = None
    reason: str = ""
    evidence: str = ""
    properties: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, data: Mapping) -> "JUnitCase":
        """Build from a dict with the attribute names as keys (``target`` may be ``classname``).

        Raises:
            ValueError: ``name`` or ``verdict`` is missing or empty, or ``duration_s`` is not a number.
        """
        name, verdict = data.get("name"), data.get("verdict")
        if not name or not verdict:
            raise ValueError(f"a JUnit case needs a name and a verdict, got {dict(data)!r:.200}")
        return cls(
            name=str(name),
            target=str(data.get("target", data.get("classname", "")) or ""),
            verdict=str(verdict),
            duration_s=float(data.get("duration_s", 0.0) or 0.0),
            bound=data.get("bound"),
            measured=data.get("measured"),
            reason=str(data.get("reason", "") or ""),
            evidence=str(data.get("evidence", "") or ""),
            properties={str(k): str(v) for k, v in dict(data.get("properties") or {}).items()},
        )


@dataclass(frozen=True)
class JUnitSummary:
    """What :func:`write_junit` wrote: the file and its counts (``malformed`` cases were skipped)."""

    path: Path
    tests: int
    failures: int
    errors: int
    skipped: int
    malformed: int
    time_s: float


def _clean(text: object) -> str:
    return _XML_ILLEGAL.sub("\ufffd", "" if text is None else str(text))


def _seconds(value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _show(value: float | str | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f} s"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value} s"
    return str(value)


def _message(case: JUnitCase) -> str:
    text = f"{case.reason or case.verdict} (bound: {_show(case.bound)}; measured: {_show(case.measured)})"
    text = _clean(text)
    return text if len(text) <= MESSAGE_MAX_CHARS else text[: MESSAGE_MAX_CHARS - 1] + "\u2026"


def write_junit(
    path: str | Path, suite_name: str, cases: Iterable[JUnitCase | Mapping], *,
    timestamp: datetime | None = None, hostname: str | None = None,
) -> JUnitSummary:
    """Write one ``<testsuites>`` with one ``<testsuite>`` of the given cases to ``path``.

    Args:
        path: the XML file to write (parent directories are created).
        suite_name: ``testsuite/@name`` (and ``testsuites/@name``), e.g. ``leasekit-chaos``.
        cases: :class:`JUnitCase` objects or mappings for :meth:`JUnitCase.from_mapping`; a case
            that is neither, or a malformed mapping, is counted (``malformed``) and skipped.
        timestamp: ``testsuite/@timestamp`` (ISO 8601, seconds, UTC when aware); default now (UTC).
        hostname: ``testsuite/@hostname``; default this host's name.

    Returns:
        The :class:`JUnitSummary` (path and counts, as written in the attributes).

    Raises:
        OSError: the file cannot be written.
    """
    good: list[JUnitCase] = []
    malformed = 0
    for case in cases:
        if isinstance(case, JUnitCase):
            good.append(case)
            continue
        try:
            good.append(JUnitCase.from_mapping(case))
        except (AttributeError, TypeError, ValueError):
            malformed += 1

    when = timestamp or datetime.now(timezone.utc)
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc).replace(tzinfo=None)
    failures = sum(1 for c in good if c.verdict == FAIL)
    skipped = sum(1 for c in good if c.verdict == UNKNOWN)
    errors = sum(1 for c in good if c.verdict not in (PASS, FAIL, UNKNOWN))
    total = sum(_seconds(c.duration_s) for c in good)
    counts = {
        "tests": str(len(good)), "failures": str(failures), "errors": str(errors),
        "skipped": str(skipped), "time": f"{total:.3f}",
    }
    root = ET.Element("testsuites", {"name": _clean(suite_name), **counts})
    suite = ET.SubElement(root, "testsuite", {
        "name": _clean(suite_name), **counts,
        "timestamp": when.isoformat(timespec="seconds"),
        "hostname": _clean(hostname if hostname is not None else socket.gethostname()),
    })
    for case in good:
        el = ET.SubElement(suite, "testcase", {
            "classname": _clean(case.target), "name": _clean(case.name), "time": f"{_seconds(case.duration_s):.3f}",
        })
        props = [(k, v) for k, v in sorted(case.properties.items()) if v]
        if props:
            holder = ET.SubElement(el, "properties")
            for key, value in props:
                ET.SubElement(holder, "property", {"name": _clean(key), "value": _clean(value)})
        message = _message(case)
        if case.verdict == FAIL:
            ET.SubElement(el, "failure", {"message": message, "type": FAIL}).text = _clean(case.reason)
        elif case.verdict == UNKNOWN:
            ET.SubElement(el, "skipped", {"message": message})
        elif case.verdict != PASS:
            ET.SubElement(el, "error", {
                "message": _clean(f"verdict {case.verdict!r} is not PASS/FAIL/UNKNOWN: ") + message,
                "type": _clean(case.verdict)[:100],
            }).text = _clean(case.reason)
        out = [
            f"verdict: {case.verdict}",
            f"bound: {_show(case.bound)}",
            f"measured: {_show(case.measured)}",
            f"reason: {case.reason}",
        ]
        if case.evidence:
            out += ["", case.evidence]
        ET.SubElement(el, "system-out").text = _clean("\n".join(out))

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    ET.indent(root)
    ET.ElementTree(root).write(target, encoding="utf-8", xml_declaration=True)
    return JUnitSummary(target, len(good), failures, errors, skipped, malformed, total)
