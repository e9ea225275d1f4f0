"""Declarative scenario files (TOML, one per scenario, in the ``chaos/`` catalog).

The loader validates with pydantic and refuses unknown fields, naming the bad field, its value and
the allowed range or values. Durations are seconds. Time fields may be lease-relative expressions
(``"E + 4s"``, grammar in :mod:`leasekit.chaos.leasetime`): a loaded :class:`Scenario` holds them
resolved to seconds at its ``lease.duration_s`` and keeps the text (:attr:`Scenario.time_expressions`),
so :meth:`Scenario.with_overrides` resolves them again at an overridden ``L``.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import get_args

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from leasekit.chaos.leasetime import field_bounds, resolve
from leasekit.cluster.tomlfile import read_toml
from leasekit.chaos.schema import (
    CONNECTOR_STALLS,
    ExpectSection,
    Fault,
    KillFault,
    LaunchSection,
    LeaseSection,
    HeartbeatFault,
    NoFault,
    PartitionFault,
    StallFault,
    SteadyStateSection,
    Strict,
    TopologySection,
    WorkloadSection,
)

CATALOG_ENV = "LEASEKIT_CHAOS_DIR"


class ScenarioError(ValueError):
    """A scenario file is missing or invalid; the message names the file, field and allowed values."""


class Scenario(Strict):
    """One chaos scenario. ``incident`` names the incident class(es) it reproduces, ``K01``..``K13``
    comma-separated (the simulator cases of ``tests/sim/test_cases_*.py``, one section per class)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    description: str
    incident: str = Field(pattern=r"^K(0[1-9]|1[0-3])(,K(0[1-9]|1[0-3]))*$")
    lease: LeaseSection = LeaseSection()
    topology: TopologySection = TopologySection()
    launch: LaunchSection = LaunchSection()
    workload: WorkloadSection = WorkloadSection()
    steady_state: SteadyStateSection = SteadyStateSection()
    faults: list[Fault] = Field(min_length=1, max_length=3)
    expect: ExpectSection
    _expressions: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _resolve_times(self) -> "Scenario":
        """Replace every time/count expression by its value at ``lease.timing()``, keeping the text."""
        timing = self.lease.timing()
        expressions: dict[str, str] = {}

        def resolved(section: BaseModel, path: str) -> BaseModel:
            update = {}
            for name, info in type(section).model_fields.items():
                bounds, value = field_bounds(info.metadata), getattr(section, name)
                if bounds is not None and isinstance(value, str):
                    expressions[f"{path}.{name}"] = value
                    update[name] = resolve(value, bounds, timing, f"{path}.{name}")
            return section.model_copy(update=update) if update else section

        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, BaseModel):
                object.__setattr__(self, name, resolved(value, name))
            elif isinstance(value, list) and all(isinstance(item, BaseModel) for item in value):
                object.__setattr__(self, name, [resolved(item, f"{name}.{i}") for i, item in enumerate(value)])
        self._expressions = expressions
        return self

    @property
    def time_expressions(self) -> dict[str, str]:
        """``{dotted field path: expression as written}`` for every field written as a lease-relative
        expression, e.g. ``{"faults.0.duration_s": "E + 4s"}`` (the field itself holds its value
        in seconds, or the heartbeat count, at this scenario's ``L``)."""
        return dict(self._expressions)

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        w = self.workload
        if w.cancel_queued_fraction + w.never_decode_fraction > 1:
            raise ValueError("workload.cancel_queued_fraction + workload.never_decode_fraction must be <= 1, "
                             f"got {w.cancel_queued_fraction} + {w.never_decode_fraction}")
        if self.topology.transfer_mode == "push" and "fail_closed" in self.expect.checks:
            raise ValueError("expect.checks: fail_closed cannot be judged in push mode (P WRITEs into D, and a stock "
                             "P logs no late event for a WRITE that finishes after its lease expired): remove it")
        if w.kind == "overload" and w.hold_decode_slot_s is not None:
            raise ValueError("workload.hold_decode_slot_s: an overload holds no slot for a time (the routed requests "
                             "keep D's last free slot busy): remove it, or use kind = 'queued'")
        if w.kind != "overload" and w.queue_wait_s is not None:
            raise ValueError(f"workload.queue_wait_s applies to kind = 'overload' only, got kind = {w.kind!r}: "
                             "remove it, or use kind = 'overload'")
        if w.kind != "abort_storm" and w.cancel_after_s is not None:
            raise ValueError(f"workload.cancel_after_s applies to kind = 'abort_storm' only, got kind = {w.kind!r}")
        for i, fault in enumerate(self.faults):
            if isinstance(fault, HeartbeatFault) and fault.target != "decode":
                raise ValueError(f"faults.{i}.target: heartbeat faults live in D's send path: 'decode' only")
            if isinstance(fault, KillFault) and fault.restart_after_s is not None and fault.target != "decode":
                raise ValueError(f"faults.{i}.restart_after_s: only a killed D is restarted (target = 'decode')")
            connector_only = isinstance(fault, HeartbeatFault) or (isinstance(fault, StallFault)
                                                                   and fault.method in CONNECTOR_STALLS)
            if isinstance(fault, StallFault) and fault.method == "push_writer":
                if fault.target != "prefill" or self.topology.transfer_mode != "push":
                    raise ValueError(f"faults.{i}: method = 'push_writer' stalls P's push writer thread: it needs "
                                     "target = 'prefill' and topology.transfer_mode = 'push'")
                if len(self.faults) > 1:  # it starts only at P's next WRITE: its window cannot be ordered with others
                    raise ValueError(f"faults.{i}: a push_writer stall must be the scenario's only fault "
                                     f"(it has {len(self.faults)}): split the scenario")
                if w.kind not in ("queued", "abort_storm") or w.hold_decode_slot_s is None:
                    raise ValueError(f"faults.{i}: a push_writer stall starts at P's next WRITE, so D must register "
                                     "while it is armed: use workload.kind = 'queued' (or 'abort_storm') with "
                                     "hold_decode_slot_s set after the fault's after_s (e.g. \"2H + 1.5s\")")
                cancel, hold = self.cancel_after_s(), float(w.hold_decode_slot_s)
                if w.kind == "abort_storm" and not hold < cancel < hold + float(fault.duration_s):
                    raise ValueError(f"workload.cancel_after_s: with a push_writer stall an abort storm cancels requests "
                                     f"D registered whose WRITE the stall holds, so it must be later than "
                                     f"hold_decode_slot_s ({hold:g} s) and earlier than that + faults.{i}.duration_s "
                                     f"({hold + float(fault.duration_s):g} s), got {cancel:g} s")
                if float(w.hold_decode_slot_s) <= float(self.fault_after_s(fault)):
                    raise ValueError(f"workload.hold_decode_slot_s: {float(w.hold_decode_slot_s):g} s must be later than "
                                     f"faults.{i}.after_s = {float(self.fault_after_s(fault)):g} s (D registers when the "
                                     "slot is released; the stall is armed at after_s): e.g. \"2H + 1.5s\"")
            if connector_only and "stock" in self.topology.targets and self.expect.stock != "UNKNOWN":
                raise ValueError(f"faults.{i}: a {fault.kind} fault cannot be injected into the stock connector: "
                                 "set expect.stock = 'UNKNOWN' or drop 'stock' from topology.targets")
            if isinstance(fault, PartitionFault):
                if not self.launch.network_namespace:
                    raise ValueError(f"faults.{i}: a partition needs launch.network_namespace = true")
                if fault.first_handshake and self.launch.warm_up:
                    raise ValueError(f"faults.{i}: first_handshake needs launch.warm_up = false (D must not have met P)")
        return self

    def with_overrides(self, *, lease_duration_s: float | None = None, tick_s: float | None = None,
                       targets: list[str] | None = None) -> "Scenario":
        """A copy with command-line overrides applied and re-validated; lease-relative expressions
        are resolved again at the new ``L``.

        Raises:
            ScenarioError: an override is out of range, or an expression resolves out of its
                field's range at the new ``L``.
        """
        data = self.model_dump()
        for path, text in self._expressions.items():
            *parents, leaf = path.split(".")
            node = data
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            node[leaf] = text
        if lease_duration_s is not None:
            data["lease"]["duration_s"] = lease_duration_s
        if tick_s is not None:
            data["lease"]["tick_s"] = tick_s
        if targets:
            data["topology"]["targets"] = list(targets)
        return _validate(data, f"{self.name!r} with overrides (the --lease-duration option or the pair file's "
                               "lease_duration_s sets lease.duration_s, --tick lease.tick_s)")

    def hold_decode_slot_s(self) -> float:
        """Seconds D's slot is held in the steady-state run (default ``1.5 * L``)."""
        return self.workload.hold_decode_slot_s or 1.5 * float(self.lease.duration_s)

    def cancel_after_s(self) -> float:
        """Seconds after routing a cancelled request's client gives up (``abort_storm``; default ``0.5 * L``)."""
        w = self.workload
        return float(w.cancel_after_s) if w.cancel_after_s is not None else 0.5 * float(self.lease.duration_s)

    def fault_after_s(self, fault) -> float:
        """Seconds between "queued" and ``fault`` (its ``after_s``, else a default per kind):
        kill ``(L - E) + 2H + 0.5`` (the last heartbeat, not the grant, then sets the bound); other
        faults ``2H + 0.5`` (P has seen heartbeats first); a first-handshake partition 0."""
        if getattr(fault, "after_s", None) is not None:
            return fault.after_s
        t = self.lease.timing()
        H = float(t.heartbeat_interval_s)
        if isinstance(fault, KillFault):
            return float(t.lease_duration_s - t.extension_s) + 2 * H + 0.5
        if isinstance(fault, PartitionFault) and fault.first_handshake:
            return 0.0
        if isinstance(fault, NoFault):
            return 0.0
        return 2 * H + 0.5


def _allowed_range(loc: tuple) -> str | None:
    """"a < x <= b" for the numeric field at ``loc`` (from its Field constraints), else None."""
    model: type[BaseModel] | None = Scenario
    info = None
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        annotation = info.annotation
        args = getattr(annotation, "__args__", ())
        candidates = [annotation, *args]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            for arg in args:  # list[KillFault]
                model = model or next((c for c in getattr(arg, "__args__", (arg,)) if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if info is None:
        return None
    low = high = ""
    for item in info.metadata:
        if getattr(item, "gt", None) is not None:
            low = f"{item.gt} < "
        if getattr(item, "ge", None) is not None:
            low = f"{item.ge} <= "
        if getattr(item, "lt", None) is not None:
            high = f" < {item.lt}"
        if getattr(item, "le", None) is not None:
            high = f" <= {item.le}"
    return f"{low}value{high}" if low or high else None


_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+(\.[\w\[\]]+)*: ")


def _fault_kind(model: type[BaseModel]) -> str | None:
    """The ``kind`` literal of a fault section model (``KillFault`` -> ``"kill"``), or None."""
    args = getattr(getattr(model.model_fields.get("kind"), "annotation", None), "__args__", ())
    return args[0] if len(args) == 1 else None


def _known_keys(loc: tuple) -> list[str]:
    """The keys the section holding the key at ``loc`` accepts (the scenario's top level for a 1-part loc)."""
    model: type[BaseModel] | None = Scenario
    union: list[type[BaseModel]] = []
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if model is None:  # a fault union: pydantic puts the kind in the path (faults.0.kill.signl)
            model = next((m for m in union if _fault_kind(m) == part), None)
            union = []
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return []
        annotation = info.annotation
        kinds, stack = [], [annotation]
        while stack:  # list[Annotated[KillFault | StallFault | ..., discriminator]]: every type inside
            kind = stack.pop()
            kinds.append(kind)
            stack.extend(getattr(kind, "__args__", ()))
        models = [c for c in kinds if isinstance(c, type) and issubclass(c, BaseModel)]
        model, union = (models[0], []) if len(models) == 1 else (None, models)
    return sorted(model.model_fields) if model is not None else []


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid scenario {source}:"]
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "(top level)"
        message = err["msg"]
        if err["type"] == "value_error" and err.get("ctx", {}).get("error") is not None:
            message = str(err["ctx"]["error"])  # our own message, without pydantic's "Value error, "
            if not err["loc"] and _NAMES_ITS_FIELD.match(message):  # a cross-field rule that names its field
                lines.append(f"  {message}")
                continue
        if err["type"] == "extra_forbidden":
            known = _known_keys(tuple(err["loc"]))
            close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            message += "; fix: remove it or check the spelling" + (f" (did you mean {close[0]!r}?)" if close else "")
        if err["type"] == "union_tag_not_found" or err["type"] == "union_tag_invalid":
            kinds = [_fault_kind(m) for m in get_args(get_args(Fault)[0])]  # Annotated[Union[...], discriminator]
            message += f"; fix: set kind to one of the fault kinds ({', '.join(kinds)})"
        if err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
            message += f" (got {err.get('input')!r})"
        allowed = _allowed_range(tuple(err["loc"]))
        if allowed and err["type"] in {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number", "float_type", "int_type"}:
            message += f"; allowed: {allowed}"
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


def _validate(data: dict, source: str) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_format_error(exc, source)) from None


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    """Load and validate one scenario file.

    Raises:
        ScenarioError: the file is missing, not TOML, or fails validation.
    """
    path = Path(path)
    data = read_toml(path, "scenario file", ScenarioError)
    scenario = _validate(data, str(path))
    if scenario.name != path.stem:
        raise ScenarioError(f"{path}: name = {scenario.name!r} must match the file name {path.stem!r}")
    return scenario


def catalog_dir() -> Path:
    """The scenario catalog: ``$LEASEKIT_CHAOS_DIR``, else ``chaos/`` next to the package."""
    configured = os.environ.get(CATALOG_ENV)
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[2] / "chaos"


def list_scenarios(directory: Path | None = None) -> dict[str, Path]:
    """``{scenario name: file}`` for every ``*.toml`` in the catalog (the file stem is the name)."""
    directory = directory or catalog_dir()
    return {p.stem: p for p in sorted(directory.glob("*.toml"))}


def find_scenario(name: str, directory: Path | None = None) -> Scenario:
    """Load a scenario by name (or by path if ``name`` is a ``.toml`` file).

    Raises:
        ScenarioError: unknown name (the message lists the known ones) or invalid file.
    """
    if name.endswith(".toml"):
        return load_scenario(name)
    known = list_scenarios(directory)
    if name not in known:
        raise ScenarioError(
            f"unknown scenario {name!r}; known: {', '.join(known) or '(none)'} "
            f"(catalog {directory or catalog_dir()})"
        )
    scenario = load_scenario(known[name])
    if scenario.name != name:
        raise ScenarioError(f"{known[name]}: name = {scenario.name!r} must match the file name {name!r}")
    return scenario
