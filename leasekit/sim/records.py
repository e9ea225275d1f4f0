"""The sim's records: world configuration, request specs, and what the world observed."""

from __future__ import annotations

from dataclasses import dataclass, field

from leasekit.lease.config import LeaseTiming
from leasekit.lease.table import Outcome
from leasekit.sim.clock import ProcessClock


@dataclass
class WorldConfig:
    """Timings in seconds (true time unless said). ``fixed_timeout_s`` turns P into the old control:
    a fixed timeout with heartbeats ignored."""

    lease_duration_s: float = 30
    p_tick_s: float = 0.1
    d_tick_s: float = 0.1
    p_tp: int = 1
    d_tp: int = 1
    p_clock: ProcessClock = field(default_factory=ProcessClock)
    d_clock: ProcessClock = field(default_factory=ProcessClock)
    latency_s: float = 0.001
    blocks_per_rank: int = 1 << 16
    admit_every_s: float = 0.0
    max_running: int = 1 << 20
    read_s: float = 0.01
    decode_s: float = 0.5
    handshake_s: float = 0.05
    handshake_retries: int = 3
    d_handshaken: bool = True  # D met this P before (the warm-up request); False: first contact
    seed: int = 0
    fixed_timeout_s: float | None = None

    def timing(self) -> LeaseTiming:
        """P's and D's lease timing (both derive it from the same ``L``)."""
        return LeaseTiming.from_lease_duration(self.lease_duration_s)


@dataclass
class RequestSpec:
    """One request. ``prefill_end_s``: when P's last forward pass for it ends (true seconds).
    ``route_delay_s``: from the grant to D's enqueue (None: never reaches D). ``cancel_at_s``: the
    client cancels (before the prefill ends: no lease; after: P keeps the lease, D never sees it).
    ``prefix_hit``: D serves it from its prefix cache and only notifies P. ``d_local_id``: D's own id.
    Crafted ``kv_transfer_params`` (K13): ``remote_of`` makes D read (and notify for) another
    request's blocks (an unknown id, one already consumed, one whose blocks were reused);
    ``bad_blocks`` points the read at block ids out of range. ``read_fails``: the NIXL transfer
    fails (a transport failure: D recomputes and P is not notified).
    """

    req_id: str
    prefill_end_s: float
    blocks: int = 8
    route_delay_s: float | None = 0.0
    cancel_at_s: float | None = None
    prefix_hit: bool = False
    d_local_id: str | None = None
    remote_of: str | None = None
    bad_blocks: bool = False
    read_fails: bool = False

    @property
    def remote_id(self) -> str:
        """The P request id D reads and notifies for (``remote_of`` when crafted)."""
        return self.remote_of if self.remote_of is not None else self.req_id


@dataclass
class LeaseRecord:
    """One lease on one P rank: grant/end in true and local seconds, heartbeats seen."""

    req_id: str
    rank: int
    granted_true: float
    granted_local: float
    end_true: float | None = None
    end_local: float | None = None
    outcome: Outcome | None = None
    hb_arrivals_true: list[float] = field(default_factory=list)
    hb_processed_local: list[float] = field(default_factory=list)
    frees: int = 0


@dataclass
class RequestRecord:
    """One request end to end. ``d_outcome``: served, stale_detected (the read saw freed, reused or
    invalid blocks and D recomputes), transport_failed (D recomputes), lost (D died), failed
    (handshake never succeeded: recompute or error per ``kv_load_failure_policy``), or None."""

    spec: RequestSpec
    granted_true: float | None = None
    cancelled_before_grant: bool = False
    enqueued_true: float | None = None
    admitted_true: float | None = None
    read_done_true: float | None = None
    read_result: str | None = None
    d_outcome: str | None = None
    d_outcome_true: float | None = None
