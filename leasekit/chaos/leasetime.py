"""Lease-relative times and heartbeat counts in scenario files.

A time field of a scenario (a fault's ``after_s``, ``duration_s``, ...) is either a plain number of
seconds, meaning exactly that at any lease duration, or a string that is resolved against the
scenario's lease timing (after ``--lease-duration``), so one file means the same at ``L = 6 s`` and
``L = 30 s``. The string grammar (one form, no parentheses)::

    expression := term (("+" | "-") term)*
    term       := [coefficient] unit          e.g. "E", "2H", "1.5L", "4s"
    coefficient:= digits ["." digits]         (non-negative decimal)
    unit       := "L" | "H" | "E" | "s"

``L`` is ``kv_lease_duration``, ``H = L // 6`` the heartbeat interval, ``E = L * 2 // 3`` the
extension (vLLM's floor division, :class:`leasekit.lease.config.LeaseTiming`); ``s`` is one second.
Whitespace around ``+``/``-`` is free; none between a coefficient and its unit. Examples:
``"E + 4s"`` (8 s at L = 6, 24 s at L = 30), ``"L - E + 2H + 0.5s"`` (4.5 s / 20.5 s).

A heartbeat count (``drop_next``) is an integer, or ``"budget"`` / ``"budget + N"`` /
``"budget - N"``: the loss budget of :func:`leasekit.lease.bounds.loss_budget` (the largest
``k < (E - H) / H``) plus or minus a whole number.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Union

from pydantic import PlainValidator

from leasekit.lease.bounds import loss_budget
from leasekit.lease.config import LeaseTiming

TIME_GRAMMAR = ('a number of seconds (e.g. 8), or a string of terms joined by + or -, each an optional '
                'decimal coefficient directly followed by a unit L, H, E or s (e.g. "E + 4s", '
                '"L - E + 2H + 0.5s", "1.5L")')
"""The allowed forms of a time field, as error messages quote them."""

COUNT_GRAMMAR = 'a whole number (e.g. 2), or "budget", "budget + N" or "budget - N" (N a whole number)'
"""The allowed forms of a heartbeat-count field, as error messages quote them."""

UNITS = ("L", "H", "E", "s")
_TERM = re.compile(r"(\d+(?:\.\d+)?)?([A-Za-z]+)")
_COUNT = re.compile(r"budget(?:\s*([+-])\s*(\d+))?")


class LeaseTimeError(ValueError):
    """A time or count field's value does not follow its grammar, or resolves out of range."""


@dataclass(frozen=True)
class LeaseTime:
    """A parsed time expression: ``terms`` are ``(signed coefficient, unit)`` pairs, ``text`` the
    expression as written."""

    text: str
    terms: tuple[tuple[float, str], ...]

    def seconds(self, timing: LeaseTiming) -> float:
        """The value in seconds at ``timing`` (rounded to the nanosecond: ``0.1 + 0.2`` is 0.3)."""
        unit = {"L": float(timing.lease_duration_s), "H": float(timing.heartbeat_interval_s),
                "E": float(timing.extension_s), "s": 1.0}
        return round(sum(coef * unit[name] for coef, name in self.terms), 9)


def parse_time(text: str) -> LeaseTime:
    """Parse a time expression (grammar in the module docstring).

    Raises:
        LeaseTimeError: the text is empty or has a term that is not ``[coefficient]unit``; the
            message quotes the text, the offending part and :data:`TIME_GRAMMAR`.
    """
    parts = re.split(r"\s*([+-])\s*", text.strip())
    if parts and parts[0] == "" and len(parts) > 1:
        raise LeaseTimeError(f"{text!r}: starts with {parts[1]!r}; the first term takes no sign. Allowed: {TIME_GRAMMAR}")
    terms = []
    for index in range(0, len(parts), 2):
        sign = -1.0 if index and parts[index - 1] == "-" else 1.0
        token = parts[index]
        match = _TERM.fullmatch(token)
        if not token:
            raise LeaseTimeError(f"{text!r}: a term is missing (empty, or two signs in a row). Allowed: {TIME_GRAMMAR}")
        if match is None or match.group(2) not in UNITS:
            hint = f"; write {token}s for {token} seconds" if re.fullmatch(r"\d+(?:\.\d+)?", token) else ""
            raise LeaseTimeError(f"{text!r}: term {token!r} is not a coefficient followed by one of "
                                 f"L, H, E, s{hint}. Allowed: {TIME_GRAMMAR}")
        coef = float(match.group(1)) if match.group(1) else 1.0
        terms.append((sign * coef, match.group(2)))
    return LeaseTime(text.strip(), tuple(terms))


def resolve_count(text: str, timing: LeaseTiming) -> int:
    """A heartbeat count at ``timing``: ``"budget"`` is :func:`leasekit.lease.bounds.loss_budget`.

    Raises:
        LeaseTimeError: the text does not follow :data:`COUNT_GRAMMAR`.
        leasekit.lease.config.LeaseConfigError: the budget is undefined at this ``L`` (``L < 6``).
    """
    match = _COUNT.fullmatch(text.strip())
    if match is None:
        raise LeaseTimeError(f"{text!r} is not a heartbeat count. Allowed: {COUNT_GRAMMAR}")
    offset = int(match.group(2) or 0) * (-1 if match.group(1) == "-" else 1)
    return loss_budget(timing) + offset


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a time or count field (``gt``/``ge`` below, ``le`` above; None: open).
    Kept in the field's metadata so the scenario checks resolved expressions against it."""

    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    count: bool = False

    def describe(self) -> str:
        """``"0 < value <= 600"``."""
        low = f"{self.gt} < " if self.gt is not None else f"{self.ge} <= " if self.ge is not None else ""
        high = f" <= {self.le}" if self.le is not None else ""
        return f"{low}value{high}"

    def violated(self, value: float) -> bool:
        """Whether ``value`` lies outside the range."""
        return ((self.gt is not None and not value > self.gt) or (self.ge is not None and not value >= self.ge)
                or (self.le is not None and not value <= self.le))


def _time_validator(bounds: Bounds, optional: bool):
    def validate(value: object) -> float | str | None:
        if value is None and optional:
            return None
        if isinstance(value, str):
            parse_time(value)
            return value.strip()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LeaseTimeError(f"not a time. Allowed: {TIME_GRAMMAR}")
        if bounds.violated(value):
            raise LeaseTimeError(f"out of range; allowed: {bounds.describe()} (seconds), or a lease-relative expression")
        return float(value)
    return validate


def _count_validator(bounds: Bounds):
    def validate(value: object) -> int | str:
        if isinstance(value, str):
            if _COUNT.fullmatch(value.strip()) is None:
                raise LeaseTimeError(f"{value!r} is not a heartbeat count. Allowed: {COUNT_GRAMMAR}")
            return value.strip()
        if isinstance(value, bool) or not isinstance(value, int):
            raise LeaseTimeError(f"{value!r} is not a heartbeat count. Allowed: {COUNT_GRAMMAR}")
        if bounds.violated(value):
            raise LeaseTimeError(f"out of range; allowed: {bounds.describe()}, or a budget expression")
        return value
    return validate


def lease_seconds(*, gt: float | None = None, ge: float | None = None, le: float | None = None,
                  optional: bool = False):
    """A pydantic field type for a time: a finite number of seconds within the bounds (returned as
    float), an expression (kept as its text until the scenario resolves it), or, if ``optional``,
    None."""
    bounds = Bounds(gt=gt, ge=ge, le=le)
    return Annotated[Union[float, str, None], PlainValidator(_time_validator(bounds, optional)), bounds]


def heartbeat_count(*, ge: int | None = None, le: int | None = None):
    """A pydantic field type for a heartbeat count: an int within the bounds, or a budget expression."""
    bounds = Bounds(ge=ge, le=le, count=True)
    return Annotated[Union[int, str], PlainValidator(_count_validator(bounds)), bounds]


def field_bounds(metadata: list) -> Bounds | None:
    """The :class:`Bounds` among a field's metadata (None: not a time or count field)."""
    return next((item for item in metadata if isinstance(item, Bounds)), None)


def resolve(value: str, bounds: Bounds, timing: LeaseTiming, field: str) -> float | int:
    """Resolve the expression ``value`` of ``field`` at ``timing`` and check it against ``bounds``.

    Raises:
        LeaseTimeError: out of range or undefined at this ``L``; the message names ``field``, the
            expression, its value, ``L``/``H``/``E`` and the allowed range.
    """
    at = (f"at L = {timing.lease_duration_s:g} s (H = {timing.heartbeat_interval_s:g} s, "
          f"E = {timing.extension_s:g} s)")
    try:
        result: float | int = resolve_count(value, timing) if bounds.count else parse_time(value).seconds(timing)
    except ValueError as exc:  # LeaseConfigError: no loss budget below L = 6
        raise LeaseTimeError(f"{field} = {value!r} cannot be resolved {at}: {exc}") from None
    if bounds.violated(result):
        unit = "" if bounds.count else " s"
        raise LeaseTimeError(f"{field} = {value!r} is {result:g}{unit} {at}; allowed: {bounds.describe()}"
                             f"{'' if bounds.count else ' (seconds)'}")
    return result
