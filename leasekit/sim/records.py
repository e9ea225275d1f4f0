"""The sim's records: world configuration, request specs, and what the world observed (pull and push mode)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from leasekit.lease.config import LeaseTiming
from leasekit.lease.table import Outcome
from leasekit.sim.clock import ProcessClock


@dataclass
class WorldConfig:
    """Timings in seconds (true time unless said). ``fixed_timeout_s`` turns P into the old control:
    a fixed timeout with heartbeats ignored.

    ``transfer_mode``: ``"pull"`` (D READs P's blocks and notifies P) or ``"push"`` (D registers its blocks,
    P WRITEs into them: :mod:`leasekit.sim.push`). Push only: ``write_s``, one WRITE from issue to completion;
    ``push_timeout_s``, how long after its registration D waits for the WRITE before it gives up on the request
    (frees its D blocks, stops heartbeating it; vLLM's ``push_registration_timeout``, default
    ``decoder_kv_blocks_ttl`` = 480 s); ``decode_s``, how long D keeps a served request's blocks.
    """

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
    transfer_mode: str = "pull"
    write_s: float = 0.05
    push_timeout_s: float = 480.0

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
    d_abort_at_s: float | None = None
    write_s: float | None = None
    stray_completion: bool = False

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
    (handshake never succeeded: recompute or error per ``kv_load_failure_policy``), push mode only
    aborted (``d_abort_at_s``) or timed_out (``push_timeout_s`` without the WRITE), or None.
    Push mode: ``registered_true`` when D allocated its blocks and sent PUSH_REG; ``landed_true`` when the
    last P rank's WRITE landed on D; ``push_sources``, what each landed WRITE read on P (ok, freed, reused)."""

    spec: RequestSpec
    granted_true: float | None = None
    cancelled_before_grant: bool = False
    enqueued_true: float | None = None
    admitted_true: float | None = None
    read_done_true: float | None = None
    read_result: str | None = None
    d_outcome: str | None = None
    d_outcome_true: float | None = None
    registered_true: float | None = None
    landed_true: float | None = None
    push_sources: list[str] = field(default_factory=list)


@dataclass
class WriteRecord:
    """One push-mode WRITE of one P rank (true seconds unless ``_local``: P's clock).

    ``outcome``: ``landed`` (reached D's engine), ``failed`` (D's engine was dead or replaced: NIXL error) or
    ``p_dead``; None while in flight. ``source``: what the WRITE read on P at its completion (``ok``, ``freed``,
    ``reused``: P freed the lease's blocks before the WRITE ended). ``dest``: what D's target blocks held when it
    landed (``ok``, ``freed``, ``reused``: D had given up and another request owns them). ``observed_local``:
    the P step that saw it done; ``p_view``: what P did then (``released``, ``late``: the lease had already
    ended, ``failed``: nothing, the lease keeps its deadline)."""

    req_id: str
    rank: int
    d_generation: int
    issued_true: float
    issued_local: float
    duration_s: float
    done_true: float | None = None
    outcome: str | None = None
    source: str | None = None
    dest: str | None = None
    observed_local: float | None = None
    p_view: str | None = None


@dataclass
class PushRecords:
    """What a push world observed: ``regs_sent`` ``(true s, req id, D rank, P rank)``; ``reg_arrivals``
    ``(true s, P rank, req id, decision)`` (decision ``accepted``, ``held`` or a drop reason of
    :mod:`leasekit.lease.pushreg`); ``reg_drops`` by reason (held ones dropped later included); ``writes``;
    ``late_writes`` (P saw the WRITE done after the lease had ended); ``reused_d_writes`` (landed in D blocks
    another request owns); ``counters``: ``completions_dropped`` (read completions a push P ignored),
    ``d_late_writes`` (WRITEs landing on a request D no longer waits for)."""

    regs_sent: list[tuple[float, str, int, int]] = field(default_factory=list)
    reg_arrivals: list[tuple[float, int, str | None, str]] = field(default_factory=list)
    reg_drops: Counter = field(default_factory=Counter)
    writes: list[WriteRecord] = field(default_factory=list)
    late_writes: list[WriteRecord] = field(default_factory=list)
    reused_d_writes: list[WriteRecord] = field(default_factory=list)
    counters: Counter = field(default_factory=Counter)
