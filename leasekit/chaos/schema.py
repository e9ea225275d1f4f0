"""The sections of a scenario file (TOML). All durations are seconds; every field is validated
strictly (no silent coercion) and unknown fields are refused.

Fault times are relative to the moment every workload request sits in D's queue ("queued"). Time
fields (typed with :func:`leasekit.chaos.leasetime.lease_seconds`) take a number of seconds or a
lease-relative expression such as ``"E + 4s"``; the scenario resolves expressions against its lease
timing (:meth:`leasekit.chaos.scenario.Scenario`), so after loading every time field is a float.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from leasekit.chaos.leasetime import heartbeat_count, lease_seconds
from leasekit.lease.config import LeaseTiming

TARGETS = ("leasekit", "stock")
"""Conformance targets: LeaseKitConnector on P and D, or vLLM's stock NixlConnector on P and D."""

CHECKS = ("bounded_reclaim", "no_expiry", "all_served", "fail_closed", "liveness", "conservation", "decode_conservation",
          "no_late_write")
CheckName = Literal["bounded_reclaim", "no_expiry", "all_served", "fail_closed", "liveness", "conservation",
                    "decode_conservation", "no_late_write"]
"""Checks a scenario can ask for (see leasekit.chaos.checks)."""


class Strict(BaseModel):
    """Base: strict types (an int is still accepted for a float), no unknown fields, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LeaseSection(Strict):
    """``[lease]``: ``duration_s`` is ``kv_lease_duration``; ``tick_s`` bounds P's step period."""

    duration_s: float = Field(6, gt=0, le=3600)
    tick_s: float = Field(0.5, ge=0, le=60)

    def timing(self) -> LeaseTiming:
        """The derived ``L``, ``H``, ``E`` (an integral duration stays an int, as vLLM keeps it)."""
        L = int(self.duration_s) if float(self.duration_s).is_integer() else self.duration_s
        return LeaseTiming.from_lease_duration(L)


class TopologySection(Strict):
    """``[topology]``: D's running-slot limit, which targets the scenario runs against, and the NIXL
    transfer mode: ``pull`` (D reads P's KV blocks) or ``push`` (P writes them into D: LeaseKitPushConnector on
    the ``leasekit`` target, vLLM's ``NixlPushConnector`` on ``stock``)."""

    decode_max_num_seqs: int = Field(1, ge=1, le=256)
    targets: list[Literal["leasekit", "stock"]] = Field(default_factory=lambda: list(TARGETS), min_length=1)
    transfer_mode: Literal["pull", "push"] = "pull"


class LaunchSection(Strict):
    """``[launch]``: conditions set when the servers start (clock skew; ``network_namespace``: P and D
    on two hosts, :mod:`leasekit.cluster.testbed`, which partition faults need)."""

    prefill_monotonic_offset_s: float = Field(0, ge=0, le=10**7)
    decode_monotonic_offset_s: float = Field(0, ge=0, le=10**7)
    prefill_wall_offset_s: float = Field(0, ge=-(10**8), le=10**8)
    prefill_wall_rate: float = Field(1.0, gt=0, le=100)
    decode_wall_offset_s: float = Field(0, ge=-(10**8), le=10**8)
    decode_wall_rate: float = Field(1.0, gt=0, le=100)
    network_namespace: bool = False
    warm_up: bool = True
    fail_closed: bool = True
    """LeaseKit target only: P's ``leasekit_fail_closed`` (docs/fail-closed.md; the connector's default,
    true; false runs the scenario with the protocol off)."""


class WorkloadSection(Strict):
    """``[workload]``: ``queued`` (N P->D requests behind a long generation holding D's slot),
    ``overload`` (N requests each decoding ``decode_tokens``, queued behind each other), or
    ``abort_storm`` (N requests, a fraction cancelled while queued on D, a fraction never sent to D).

    ``hold_decode_slot_s``: for ``queued``/``abort_storm``, how long after "queued" D's running
    slots stay held before D may serve the queue; None means ``1.5 * L`` in the steady state and
    "until the fault is over plus the bound" in the fault run. ``cancel_after_s``: for
    ``abort_storm``, how long after it was routed a cancelled request's client gives up (None:
    ``0.5 * L``; the cancelled requests are routed together, once every other one waits on D). ``prefill_rps``: extra prefill-only traffic on P during the fault run.
    ``queue_wait_s``: for ``overload``, how long the last routed request should wait for its answer
    (seconds, or lease-relative such as ``"2L"``); the run then sizes each request's decode from D's
    decode step time measured just before, at most ``decode_tokens`` tokens (None: always
    ``decode_tokens``), so the overload lasts about as long on a fast GPU D as on a CPU D.
    ``answer_within_s``: each routed request not meant to be cancelled gives up (its client disconnects, so D
    aborts it) after this long; one that got no HTTP answer by then counts as never answered for ``liveness``
    (None: wait for every answer; a hung request then holds its client until the run's decode wait ends).
    """

    kind: Literal["queued", "overload", "abort_storm"] = "queued"
    requests: int = Field(4, ge=1, le=256)
    prompt_tokens: int = Field(48, ge=1, le=2048)
    decode_tokens: int = Field(4, ge=1, le=1024)
    hold_decode_slot_s: lease_seconds(gt=0, le=3600, optional=True) = None
    cancel_after_s: lease_seconds(gt=0, le=600, optional=True) = None
    queue_wait_s: lease_seconds(gt=0, le=3600, optional=True) = None
    answer_within_s: lease_seconds(gt=0, le=3600, optional=True) = None
    prefill_rps: float = Field(0, ge=0, le=50)
    cancel_queued_fraction: float = Field(0.0, ge=0, le=1)
    never_decode_fraction: float = Field(0.0, ge=0, le=1)


class SteadyStateSection(Strict):
    """``[steady_state]``: the hypothesis checked on the same workload without the fault."""

    enabled: bool = True
    expiries: int = Field(0, ge=0)
    all_served: bool = True


class _FaultBase(Strict):
    target: Literal["decode", "prefill"] = "decode"
    after_s: lease_seconds(ge=0, le=3600, optional=True) = None


class KillFault(_FaultBase):
    """SIGKILL/SIGTERM the whole process group, or the engine-core process alone. ``after_s`` None:
    ``(L - E) + 2H + 0.5`` so the last heartbeat, not the grant, sets the bound."""

    kind: Literal["kill"]
    signal: Literal["SIGKILL", "SIGTERM"] = "SIGKILL"
    scope: Literal["group", "engine_core"] = "group"
    restart_after_s: lease_seconds(ge=0, le=3600, optional=True) = None


CONNECTOR_STALLS = ("forward_pass", "push_writer")
"""Stall methods that are fault points inside LeaseKit's connector (a stock connector has none)."""


class StallFault(_FaultBase):
    """Stop a server for ``duration_s``: SIGSTOP/SIGCONT, the cgroup freezer, or a fault point inside LeaseKit's
    connector (not available on a stock connector): ``forward_pass`` (one forward pass takes ``duration_s``) or
    ``push_writer`` (push mode, P: vLLM's ``nixl-push-writer`` thread sleeps ``duration_s`` before its next WRITE;
    armed at ``after_s``, it starts when that WRITE comes)."""

    kind: Literal["stall"]
    method: Literal["sigstop", "freezer", "forward_pass", "push_writer"] = "sigstop"
    duration_s: lease_seconds(gt=0, le=600)


class HeartbeatFault(_FaultBase):
    """Heartbeat faults in D's send path (LeaseKitConnector only): drop the next ``drop_next``
    batches in a row, drop a ``drop_fraction``, delay each by ``delay_s``, send ``duplicate`` copies.
    ``delay_next_s`` delays the first batch after the drops (pushes a tie past the deadline).
    ``drop_next`` may be ``"budget"``/``"budget + 1"``: the loss budget at the scenario's ``L``."""

    kind: Literal["heartbeats"]
    drop_next: heartbeat_count(ge=0, le=1000) = 0
    drop_fraction: float = Field(0, ge=0, le=1)
    delay_s: lease_seconds(ge=0, le=600) = 0.0
    duplicate: int = Field(1, ge=1, le=100)
    delay_next_s: lease_seconds(ge=0, le=600) = 0.0
    duration_s: lease_seconds(gt=0, le=600, optional=True) = None


class PartitionFault(_FaultBase):
    """A partition between P's host and D's host (the pair runs on two hosts: ``launch.network_namespace``),
    for ``duration_s``: nftables rules inside ``target``'s host (:mod:`leasekit.chaos.faults.partition`).

    ``path``: ``all`` (every packet between the hosts: NIXL/UCX reads and notifications, the side
    channel, LeaseKit's verdict channel), ``nixl`` (all but the NIXL side channels' TCP), ``side_channel``
    (TCP to/from ``target``'s side-channel port), ``http`` (TCP to/from ``target``'s HTTP port: the router's
    requests). ``direction``: ``both``, or one way, ``decode_to_prefill`` / ``prefill_to_decode``: what that
    side sends as data is lost while bare TCP acknowledgements still pass, so the other direction keeps
    working (``http``: ``both`` only). ``action``: ``drop``, ``reject`` (TCP reset / ICMP) or random
    ``loss`` of ``loss_percent`` % (a whole number). ``first_handshake``: applied before D first meets P
    (the pair is started without warm-up)."""

    kind: Literal["partition"]
    path: Literal["all", "nixl", "side_channel", "http"] = "side_channel"
    direction: Literal["both", "decode_to_prefill", "prefill_to_decode"] = "both"
    action: Literal["drop", "reject", "loss"] = "drop"
    loss_percent: float = Field(100, ge=0, le=100)
    duration_s: lease_seconds(gt=0, le=600)
    first_handshake: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> "PartitionFault":
        if self.path == "http" and self.direction != "both":
            raise ValueError(f"direction must be 'both' for path = 'http' (HTTP runs between the router and a server, "
                             f"not between P and D), got {self.direction!r}")
        if self.action != "loss" and self.loss_percent != 100:  # (100, the default, is what drop and reject lose)
            raise ValueError(f"loss_percent applies to action = 'loss' only, got action = {self.action!r}: "
                             "remove loss_percent, or set action = 'loss'")
        if self.action == "loss" and self.loss_percent == 0:
            raise ValueError("loss_percent = 0 with action = 'loss' loses nothing (the fault could never take effect); "
                             "allowed: 1 <= loss_percent <= 100")
        if not float(self.loss_percent).is_integer():
            raise ValueError(f"loss_percent must be a whole number of percent (nftables numgen), got {self.loss_percent!r}")
        return self


class NoFault(Strict):
    """No fault: the scenario checks a launch condition or a load (skew, wall clock, overload)."""

    kind: Literal["none"]


Fault = Annotated[Union[KillFault, StallFault, HeartbeatFault, PartitionFault, NoFault], Field(discriminator="kind")]


class ExpectSection(Strict):
    """``[expect]``: the verdict per target, the checks that decide it, and known defects (shown when
    the expected verdict is FAIL: the invariant and the vLLM line that breaks it)."""

    leasekit: Literal["PASS", "FAIL", "UNKNOWN"] = "PASS"
    stock: Literal["PASS", "FAIL", "UNKNOWN"] = "PASS"
    checks: list[CheckName] = Field(min_length=1)
    failing_checks: list[CheckName] = Field(default_factory=list)
    known_defect_leasekit: str | None = None
    known_defect_stock: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "ExpectSection":
        if len(set(self.checks)) != len(self.checks):
            raise ValueError(f"expect.checks: each check once, got {self.checks}")
        for target in TARGETS:
            if self.verdict_for(target) == "FAIL":
                if not getattr(self, f"known_defect_{target}"):
                    raise ValueError(f"expect.{target} = 'FAIL' needs expect.known_defect_{target}: the invariant and the vLLM line that breaks it")
                if not self.failing_checks:
                    raise ValueError(f"expect.{target} = 'FAIL' needs expect.failing_checks: exactly which checks must fail (others must pass)")
        if not set(self.failing_checks) <= set(self.checks):
            raise ValueError(f"expect.failing_checks {self.failing_checks} must be among expect.checks {self.checks}")
        return self

    def verdict_for(self, target: str) -> str:
        """The expected verdict for ``target`` (``leasekit`` or ``stock``).

        Raises:
            ValueError: another target.
        """
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        return self.leasekit if target == "leasekit" else self.stock
