"""Declarative scenario files (TOML, one per scenario, in the ``chaos/`` catalog).

The loader validates with pydantic and refuses unknown fields, naming the bad field, its value and
the allowed range or values. Durations are seconds.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from leasekit.lease.config import LeaseTiming

CATALOG_ENV = "LEASEKIT_CHAOS_DIR"


class ScenarioError(ValueError):
    """A scenario file is missing or invalid; the message names the file, field and allowed values."""


class _Strict(BaseModel):
    # strict: no silent coercion ("6" -> 6, true -> 1.0); an int is still accepted for a float.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LeaseSection(_Strict):
    """``[lease]``: ``duration_s`` is ``kv_lease_duration``; ``tick_s`` bounds P's step period."""

    duration_s: float = Field(6, gt=0, le=3600, description="kv_lease_duration, seconds")
    tick_s: float = Field(0.5, ge=0, le=60, description="allowance for P's step period, seconds")

    def timing(self) -> LeaseTiming:
        """The derived ``L``, ``H``, ``E`` (an integral duration stays an int, as vLLM keeps it)."""
        L = int(self.duration_s) if float(self.duration_s).is_integer() else self.duration_s
        return LeaseTiming.from_lease_duration(L)


class TopologySection(_Strict):
    """``[topology]``: which connector each side runs and D's running-slot limit."""

    prefill_connector: Literal["leasekit", "stock"] = "leasekit"
    decode_connector: Literal["leasekit", "stock"] = "leasekit"
    decode_max_num_seqs: int = Field(1, ge=1, le=256)


class WorkloadSection(_Strict):
    """``[workload]``: N P->D requests queued on D behind one long local generation.

    ``hold_decode_slot_s`` is how long the long generation holds D's running slot in the
    steady-state run; None means ``1.5 * L`` so the leases must live on heartbeats.
    """

    requests: int = Field(4, ge=1, le=256)
    prompt_tokens: int = Field(48, ge=1, le=2048)
    decode_tokens: int = Field(4, ge=1, le=512)
    hold_decode_slot_s: float | None = Field(None, gt=0, le=3600)


class SteadyStateSection(_Strict):
    """``[steady_state]``: the hypothesis checked on the same workload without the fault."""

    expiries: int = Field(0, ge=0)
    all_served: bool = True


class KillFault(_Strict):
    """``[[faults]] kind = "kill"``: signal a server's whole process group.

    ``after_queued_s``: seconds after every request sits in D's queue; None means
    ``(L - E) + 2 * H + 0.5``: late enough that the last delivered heartbeat, not the grant, sets
    ``max(grant + L, last heartbeat + E)``, so the run exercises the heartbeat term of the bound.
    """

    kind: Literal["kill"]
    target: Literal["decode", "prefill"] = "decode"
    signal: Literal["SIGKILL", "SIGTERM"] = "SIGKILL"
    after_queued_s: float | None = Field(None, ge=0, le=3600)


class ExpectSection(_Strict):
    """``[expect]``: the verdict this scenario should reach and which bound applies."""

    verdict: Literal["PASS", "FAIL", "UNKNOWN"] = "PASS"
    bound: Literal["reclaim"] = "reclaim"


class Scenario(_Strict):
    """One chaos scenario. ``incident`` names the public incident class (CASES.md, K01-K13)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    description: str
    incident: str = Field(pattern=r"^K(0[1-9]|1[0-3])$")
    lease: LeaseSection = LeaseSection()
    topology: TopologySection = TopologySection()
    workload: WorkloadSection = WorkloadSection()
    steady_state: SteadyStateSection = SteadyStateSection()
    faults: list[KillFault] = Field(min_length=1, max_length=1)
    expect: ExpectSection = ExpectSection()

    @model_validator(mode="after")
    def _measurable(self) -> "Scenario":
        if self.expect.bound == "reclaim" and self.topology.prefill_connector != "leasekit":
            raise ValueError(
                "topology.prefill_connector = 'stock': a stock P emits no lease spans, so the reclaim "
                "bound cannot be measured; use 'leasekit' on P (D may run 'stock')"
            )
        return self

    def with_overrides(self, *, lease_duration_s: float | None = None, tick_s: float | None = None,
                       prefill_connector: str | None = None, decode_connector: str | None = None) -> "Scenario":
        """A copy with command-line overrides applied and re-validated.

        Raises:
            ScenarioError: an override is out of range.
        """
        data = self.model_dump()
        if lease_duration_s is not None:
            data["lease"]["duration_s"] = lease_duration_s
        if tick_s is not None:
            data["lease"]["tick_s"] = tick_s
        if prefill_connector is not None:
            data["topology"]["prefill_connector"] = prefill_connector
        if decode_connector is not None:
            data["topology"]["decode_connector"] = decode_connector
        return _validate(data, "command-line overrides (--lease-duration sets lease.duration_s, --tick lease.tick_s)")

    def hold_decode_slot_s(self) -> float:
        """Seconds D's slot is held in the steady-state run (default ``1.5 * L``)."""
        return self.workload.hold_decode_slot_s or 1.5 * float(self.lease.duration_s)

    def kill_after_s(self) -> float:
        """Seconds between "all queued" and the kill (default ``(L - E) + 2 * H + 0.5``)."""
        fault = self.faults[0]
        if fault.after_queued_s is not None:
            return fault.after_queued_s
        t = self.lease.timing()
        return float(t.lease_duration_s - t.extension_s) + 2 * float(t.heartbeat_interval_s) + 0.5


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


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid scenario {source}:"]
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "(top level)"
        message = err["msg"]
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
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {path} not found") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"scenario file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario file {path} is not valid TOML: {exc}") from None
    return _validate(data, str(path))


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
