"""Every Prometheus metric LeaseKitConnector exports: the one place names, types, units and labels
are declared (etcd ``server/lease/metrics.go`` keeps its lease metrics in one file the same way).

How they reach ``/metrics``: vLLM runs the connector's workers in other processes. Each worker
records lease events into its ``KVConnectorStats`` (:mod:`leasekit.vllm.stats`), vLLM ships them
with the step output to the scheduler and on to the API server, whose ``PrometheusStatLogger``
hands them to the connector's ``KVConnectorPromMetrics`` (vllm 0.32.0
``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``, ``vllm/v1/metrics/loggers.py``).
So the metrics appear on the ``/metrics`` endpoint of the same vLLM server users already scrape,
next to vLLM's own ``vllm:nixl_*`` metrics (:data:`VLLM_NIXL_METRICS`, untouched).

Every metric carries vLLM's per-engine labels ``model_name`` and ``engine`` (the engine index
inside one server), then ``mode`` (:data:`MODE_LABEL`: ``pull`` or ``push``, the server's transfer mode), plus the
labels listed here. Counters say in their help text whether they count
per request or per TP rank (docs/lease-model.md invariant 9). All times are seconds.

Bounded labels only: ``tp_rank``, ``kv_role`` and closed sets of values declared here (cause, peer
state, outcome, proof, reason, fail_closed); on D also ``remote_engine_id``, the P engine id D
heartbeats (an engine id from D's own handshake table, one per P engine D connected to). Never a
request id (per-request detail is in the lease spans) and never a NIXL agent name: P learns which D
worker a lease belongs to only from the sender's agent name on its notifications (in pull mode D's
handshake request is only ``(GET_META_MSG, pp_rank, tp_rank)``, vllm 0.32.0
``nixl/base_scheduler.py: _nixl_handshake_listener``), and that name is a claim any peer can make and a
new value at every D restart. Spans and logs name that D by :func:`leasekit.lease.peerref.peer_ref`;
metrics say only what P knew of it at an expiry (``peer_state``, :mod:`leasekit.telemetry.peers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from leasekit.lease.codec import DECODE_ERROR_REASONS
from leasekit.lease.pushreg import DROP_REASONS as _PUSH_REG_DROP_REASONS
from leasekit.telemetry import lease_events as _ev
from leasekit.lease.readgate import READ_OUTCOMES as _READ_OUTCOMES, READ_PROOFS as _READ_PROOFS

VLLM_ENGINE_LABELS = ("model_name", "engine")
"""The labels vLLM puts on every per-engine metric (``vllm/v1/metrics/loggers.py``)."""

PREFIX = "leasekit_kv_lease_"

MODE_LABEL = "mode"
"""The label every LeaseKit metric carries after vLLM's: the server's NIXL transfer mode."""
TRANSFER_MODES = ("pull", "push")
"""``mode`` label values: ``pull`` (LeaseKitConnector: D READs P's KV blocks) and ``push``
(LeaseKitPushConnector: P WRITEs them into D's)."""
PUSH_WRITE_OUTCOMES = ("issued", "done", "failed", "late", "refused")
"""``outcome`` label values of :data:`PUSH_WRITES_METRIC`: ``issued`` (P's writer submitted the WRITEs of a lease),
``done`` (all of them finished while the lease was held: the lease was released), ``failed`` (NIXL reported one
failed: the lease is held until it expires), ``late`` (they finished after the lease had expired: P had freed the
source blocks, D may hold reused data), ``refused`` (P's writer reached the WRITE only after the lease had expired
and did not submit it: no reused blocks reach D, and D gets no KV for that request)."""

EXPIRY_CAUSES = ("no_heartbeat", "heartbeat_lapsed", "max_hold")
"""``cause`` label values of expiries: ``no_heartbeat``: the lease expired without one delivered
heartbeat (D never tracked it, or died or stalled before its first heartbeat); ``heartbeat_lapsed``:
heartbeats were delivered, then stopped for longer than the extension ``E``; ``max_hold``: the lease
reached its hard cap on total life (``leasekit_max_hold_s``, default 480 s) while still heartbeated."""

PEER_STATES = _ev.PEER_STATES
"""``peer_state`` label values of expiries: what P knew of the lease's D agent at the reap
(:mod:`leasekit.telemetry.peers`): ``heartbeating`` (it delivered a heartbeat for another lease less than
2 H before: D is alive), ``silent`` (heard from before, not in the last 2 H: D died, stalled or was cut
off), ``unknown`` (P never heard from a D about the lease)."""

NOTIFICATION_DROP_REASONS = DECODE_ERROR_REASONS + (
    "unknown_id", "duplicate", "foreign_heartbeat", "foreign_completion", "bad_hello", "internal_error",
    "unproven_heartbeat", "unproven_completion", "unproven_hello", "hello_not_allowed", "bad_heartbeat_id",
) + _PUSH_REG_DROP_REASONS + ("push_completion", "foreign_write", "duplicate_write", "backlog_full")
"""``reason`` label values of :data:`NOTIFICATIONS_DROPPED`: the codec's refusals
(:data:`leasekit.lease.codec.DECODE_ERROR_REASONS`, ``bad_protocol`` for a malformed ``LK1:`` message
among them), then ``bad_hello`` (a LeaseKit hello whose NIXL agent metadata was refused or names another
agent than its sender), ``unknown_id`` (a completion for a request P
never held), ``duplicate`` (a second completion from the same D agent for one lease),
``foreign_heartbeat`` / ``foreign_completion`` (from a NIXL agent other than the one the lease is
bound to, :mod:`leasekit.lease.binding`) and ``internal_error`` (a bug in our handling; the message
was dropped instead of crashing P's engine); ``unproven_heartbeat`` / ``unproven_completion`` (a plain message
or a wrong tag for a lease bound by proof, or a plain completion held in its claim window and voided when the
lease was proven, docs/security.md), ``unproven_hello`` (a hello that proves no lease this P granted: P opens no
connection), ``hello_not_allowed`` (a proven hello naming an address P does not allow) and ``bad_heartbeat_id``
(one junk id of a heartbeat, counted per id: the others were handled); push mode adds the registration refusals
of :data:`leasekit.lease.pushreg.DROP_REASONS` (``bad_push_reg``, ``push_reg_oversized``, ``push_reg_unknown_id``,
``push_reg_not_allowed``, ``push_reg_repeat``, ``push_reg_overflow``, ``push_reg_ambiguous_id``,
``push_reg_lease_ended``), ``push_completion`` (a read completion
sent to a push-mode P, which frees only on its own WRITEs), and on a push-mode D ``foreign_write`` / ``duplicate_write``
(a WRITE notification from an agent that is not one of the request's P engine, or a repeat from one:
:mod:`leasekit.vllm.decode.writenotes`); ``backlog_full`` (push-mode P: a notification the writer thread forwarded
while the engine thread had not taken the :data:`leasekit.vllm.pushflow.BACKLOG_MESSAGES` already waiting)."""
PROOF_KINDS = ("proven", "plain")
"""``proof`` label values of :data:`BINDINGS` (:mod:`leasekit.lease.pkeeping`: ``PROVEN``, ``PLAIN``)."""

READ_OUTCOMES = _READ_OUTCOMES
"""``outcome`` label values of :data:`READS` (:mod:`leasekit.lease.readgate`): ``verified`` (P confirmed
the lease covered the read), ``reaped`` (P had ended the lease: the read was discarded and vLLM's
``kv_load_failure_policy`` applied), ``timeout`` (no verdict in time: discarded likewise),
``unprotected`` (a stock P: the read was used unchecked, as stock vLLM does), ``abandoned`` (the request finished on
D first), ``pushed`` (push mode: P WRITEs the blocks, there is no read to gate)."""

READ_PROOFS = _READ_PROOFS
"""``proof`` label values of :data:`READ_PROOFS_METRIC` (:mod:`leasekit.lease.readgate`)."""

HOLD_OUTCOMES = ("released", "expired", "aborted")
"""``outcome`` label values of :data:`HOLD` (how the lease ended)."""

UNKNOWN_REMOTE = "unknown"
"""``remote_engine_id`` of D's zero series, before D heartbeats any P engine."""


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    Attributes:
        name: the metric family name as scraped (counters without the ``_total`` suffix that
            prometheus-client appends; see :attr:`sample_names`).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        help: the help text; for counters it says per request or per TP rank.
        labels: labels beyond :data:`VLLM_ENGINE_LABELS`.
        side: ``"P"`` (exported by prefill workers), ``"D"`` (decode workers) or ``"both"``.
        buckets: histogram bucket upper bounds in seconds (``()`` for other kinds).
        modes: the transfer modes whose servers export it (zero series included).
    """

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    side: str
    buckets: tuple[float, ...] = ()
    modes: tuple[str, ...] = TRANSFER_MODES

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The series names a scrape shows for this metric (``_total``; ``_bucket/_sum/_count``)."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


_RANK = ("tp_rank",)

LEASES_ACTIVE = MetricSpec(
    "leasekit_kv_leases_active", "gauge",
    "Leases P holds open now (requests whose KV blocks are pinned awaiting D's read), per TP rank.",
    _RANK, "P")
PINNED_BLOCKS = MetricSpec(
    PREFIX + "pinned_blocks", "gauge",
    "KV blocks pinned under open leases now, per TP rank.", _RANK, "P")
EXPIRING_SOON = MetricSpec(
    "leasekit_kv_leases_expiring_soon", "gauge",
    "Open leases whose deadline is less than one heartbeat interval H away (a heartbeat is overdue), "
    "per TP rank.", _RANK, "P")
GRANTS = MetricSpec(
    PREFIX + "grants", "counter",
    "Leases granted: counts per request per TP rank (a request served by 2 P ranks counts 2).", _RANK, "P")
EXTENSIONS = MetricSpec(
    PREFIX + "extensions", "counter",
    "Lease extensions by delivered heartbeats: counts per request per TP rank (one heartbeat naming 3 "
    "requests counts 3).", _RANK, "P")
RELEASES = MetricSpec(
    PREFIX + "releases", "counter",
    "Leases released because every consumer rank read the blocks: counts per request per TP rank.", _RANK, "P")
EXPIRIES = MetricSpec(
    PREFIX + "expiries", "counter",
    "Leases expired and their KV blocks reclaimed by P's reaper: counts per request per TP rank. Never "
    "counted as a transport failure. peer_state: what P knew of the lease's D agent at the reap (heartbeating: "
    "it still heartbeated other leases, D is alive; silent: not heard from for 2 heartbeat intervals; unknown: "
    "P never heard from a D about the lease).", _RANK + ("cause", "peer_state"), "P")
EXPIRED_PEER_RETURNS = MetricSpec(
    PREFIX + "expired_peer_returns", "counter",
    "Leases that expired while their D agent was silent (peer_state=\"silent\"), counted again when P heard "
    "from that same D agent (a heartbeat or read of a later lease) within 10 minutes of the expiry: that D was "
    "stalled or cut off, not dead (a restarted D is a new agent and never counts). Counts per expired lease per "
    "P TP rank.", _RANK, "P")
BINDINGS = MetricSpec(
    PREFIX + "bindings", "counter",
    "How P bound leases to their D, per TP rank: proof=\"proven\" by a tag from the grant's lease secret "
    "(a LeaseKit D: no other peer can move the lease), proof=\"plain\" by a stock first contact (a stock D, or "
    "a D that did not prove the lease in its claim window: exposure). A plain lease proven later counts in both.",
    _RANK + ("proof",), "P")
HEARTBEAT_UNKNOWN_IDS = MetricSpec(
    PREFIX + "heartbeat_unknown_ids", "counter",
    "Ids in D's heartbeats that P held no lease for (not granted yet, already ended, or made up): counts per "
    "id, per TP rank.", _RANK, "P")
ABORTS = MetricSpec(
    PREFIX + "aborts", "counter",
    "Leases ended neither by release nor expiry (request aborted, worker shutdown): counts per request "
    "per TP rank.", _RANK, "P")
LATE_COMPLETIONS = MetricSpec(
    PREFIX + "late_completions", "counter",
    "Read-completion notifications for a lease that had already ended (the read may have used freed KV "
    "blocks): counts per notification, i.e. per request per consumer rank, per P TP rank. fail_closed=\"true\": "
    "the D agent speaks the fail-closed protocol, P answered it 'reaped' and D discards the read (unless an "
    "ack had already proven it finished in time); "
    "fail_closed=\"false\": the read may have become tokens.",
    _RANK + ("fail_closed",), "P")
HEARTBEATS_SENT = MetricSpec(
    PREFIX + "heartbeats_sent", "counter",
    "Heartbeat notifications D sent: counts per notification (one per remote P engine per P TP rank per "
    "heartbeat interval, naming all of that engine's requests, plus one read probe per fail-closed read), "
    "per D TP rank.",
    _RANK + ("remote_engine_id",), "D")
HEARTBEAT_SEND_FAILURES = MetricSpec(
    PREFIX + "heartbeat_send_failures", "counter",
    "Heartbeat notifications D failed to send (NIXL send_notif raised): counts per notification, per D "
    "TP rank.", _RANK + ("remote_engine_id",), "D")
HOLD = MetricSpec(
    PREFIX + "hold_seconds", "histogram",
    "Seconds from grant to the lease's end (P's clock), by outcome.", _RANK + ("outcome",), "P",
    (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 6, 8, 10, 15, 20, 30, 45, 60, 120, 300, 600))
HEARTBEAT_GAP = MetricSpec(
    PREFIX + "heartbeat_gap_seconds", "histogram",
    "Seconds between consecutive delivered heartbeats for one lease (the first gap runs from the grant), "
    "on P's clock. Compare with the extension E: a gap above E expires the lease.", _RANK, "P",
    (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 60))
RECLAIM_LAG = MetricSpec(
    PREFIX + "reclaim_lag_seconds", "histogram",
    "Seconds from an expired lease's deadline to P freeing its KV blocks (the reaper's tick).", _RANK, "P",
    (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
DURATION = MetricSpec(
    PREFIX + "duration_seconds", "gauge",
    "Configured kv_lease_duration L in seconds.", ("kv_role",), "both")
HEARTBEAT_INTERVAL = MetricSpec(
    PREFIX + "heartbeat_interval_seconds", "gauge",
    "Heartbeat interval H = L // 6 in seconds (vLLM nixl/base_scheduler.py).", ("kv_role",), "both")
EXTENSION = MetricSpec(
    PREFIX + "extension_seconds", "gauge",
    "Extension E = L * 2 // 3 in seconds a heartbeat sets the deadline to (vLLM nixl/base_worker.py).",
    ("kv_role",), "both")

NOTIFICATIONS_DROPPED = MetricSpec(
    PREFIX + "notifications_dropped", "counter",
    "NIXL notifications P received and dropped without acting on them (malformed, oversized, unknown "
    "request, duplicate, or from an agent the lease is not bound to): counts per notification (per "
    "request id for heartbeat ids from a foreign agent), per P TP rank.", _RANK + ("reason",), "P")
MAX_HOLD = MetricSpec(
    PREFIX + "max_hold_seconds", "gauge",
    "Configured hard cap on one lease's total life in seconds (leasekit_max_hold_s; default 480, vLLM's "
    "old abort timeout): heartbeats never extend a lease past grant + this.", ("kv_role",), "both")

READS = MetricSpec(
    PREFIX + "reads", "counter",
    "Reads of P's KV blocks D finished, by what the read gate decided (verified, reaped, timeout, "
    "ungated, unprotected, abandoned, pushed): counts per request per D TP rank. reaped, timeout and ungated reads "
    "were discarded, never served; unprotected ones were used unchecked (stock P); abandoned ones belonged "
    "to a request that finished on D (aborted) before the verdict; pushed: push mode, P wrote the blocks (no read "
    "to gate).", _RANK + ("outcome",), "D")
READ_VERDICT_WAIT = MetricSpec(
    PREFIX + "read_verdict_wait_seconds", "histogram",
    "Seconds D held a finished read back waiting for P's verdict (the fail-closed protocol's cost: at most "
    "one notification round trip plus P's step; unprotected, abandoned and pushed reads are not observed), per D "
    "TP rank.", _RANK, "D",
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 6, 10))
READ_PROOFS_METRIC = MetricSpec(
    PREFIX + "read_proofs", "counter",
    "Verified reads by what proved P still held the blocks when D saw the read finish: pledge (the grant's "
    "pledge, no wait), ack (a heartbeat acknowledgement, no wait once it arrived) or verdict (P's answer to "
    "the completion): counts per request per D TP rank.", _RANK + ("proof",), "D")
PLEDGE_HOLD = MetricSpec(
    PREFIX + "pledge_hold_seconds", "histogram",
    "Seconds P kept a lease's blocks pinned after D's completion because the grant's pledge (leasekit_pledge_s) "
    "had not ended yet: the P memory the no-wait fast path costs; one observation per such lease, per P TP "
    "rank.", _RANK, "P",
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8))
VERDICT_SEND_FAILURES = MetricSpec(
    PREFIX + "verdict_send_failures", "counter",
    "Read verdicts P failed to send to a D agent (its ZMQ queue was full: D gone, partitioned or not reading; "
    "D discards that read after its timeout): counts per verdict, per P TP rank.", _RANK, "P")
SPAN_DROP_REASONS = ("queue_full", "export_failed")
"""``reason`` label values of :data:`SPANS_DROPPED`: ``queue_full`` (the span processor's bounded queue was
full, or shutdown gave up waiting: the span was never handed to an exporter) and ``export_failed`` (the
exporter failed: a write error such as a full disk, an OTLP error or timeout)."""
SPANS_DROPPED = MetricSpec(
    "leasekit_spans_dropped", "counter",
    "Lease and heartbeat spans this worker did not export (the export queue was full, or the span file or "
    "OTLP endpoint failed): counts per span, per TP rank, by reason. Spans are exported off the engine "
    "thread, so a slow sink drops spans instead of slowing P's steps.", _RANK + ("reason",), "both")

PUSH_WRITES_METRIC = MetricSpec(
    PREFIX + "push_writes", "counter",
    "Push mode: P's WRITEs of leased KV blocks into D, by outcome (issued, done, failed, late: finished after the "
    "lease expired, D may hold reused blocks; refused: not submitted, the lease had expired): counts per request per "
    "P TP rank.", _RANK + ("outcome",), "P",
    modes=("push",))
PUSH_LATE_WRITES = MetricSpec(
    PREFIX + "push_late_writes", "counter",
    "Push mode: WRITE notifications D received for a request it no longer waited on (it timed out or was aborted, "
    "its KV blocks may have been reused: possible silent corruption of another request): counts per notification, "
    "per D TP rank.", _RANK, "D", modes=("push",))
PUSH_WITHHELD = MetricSpec(
    PREFIX + "push_registrations_withheld", "counter",
    "Push mode: registrations D withheld because it had sent no heartbeat for the request for about E - H/2 or "
    "longer (P may have reclaimed the lease; the load is failed for kv_load_failure_policy instead of waiting for a "
    "WRITE that may never come): counts per request, per D TP rank.", _RANK, "D", modes=("push",))

HANDSHAKE_BAD_REASONS = (
    "bad_frames", "oversized", "bad_msgpack", "bad_shape", "unknown_tag", "unknown_rank", "internal_error",
)
"""``reason`` label values of :data:`HANDSHAKE_BAD_REQUESTS` (:mod:`leasekit.vllm.prefill.listener`):
``bad_frames``: not a ZMQ REQ envelope ``[identity, b"", payload]`` (extra or missing frames);
``oversized``: a frame above the listener's request limit; ``bad_msgpack``: the payload is not
msgpack; ``bad_shape``: not an array ``(tag, pp_rank, tp_rank)`` of bytes and two ints;
``unknown_tag``: a tag other than vLLM's ``GET_META_MSG``; ``unknown_rank``: a ``(pp_rank, tp_rank)``
this P does not serve; ``internal_error``: a bug in our handling (the request was dropped, the
listener kept running)."""

HANDSHAKE_LISTENER_UP = MetricSpec(
    "leasekit_kv_handshake_listener_up", "gauge",
    "1 while P's NIXL side-channel handshake listener thread runs and answers requests, 0 when it is down "
    "(no new D engine can connect). Per server engine; updated at P's engine steps.", (), "P")
HANDSHAKE_REQUESTS = MetricSpec(
    "leasekit_kv_handshake_requests", "counter",
    "Well-formed NIXL side-channel handshake requests P's listener answered with its agent metadata: "
    "counts per request (a D worker sends one per P rank it reads from when it first connects).", (), "P")
HANDSHAKE_BAD_REQUESTS = MetricSpec(
    "leasekit_kv_handshake_bad_requests", "counter",
    "Malformed NIXL side-channel handshake requests P's listener refused and survived (undecodable, wrong "
    "shape or tag, unknown rank, oversized, wrong frames): counts per request, by reason.", ("reason",), "P")

LEASEKIT_METRICS: tuple[MetricSpec, ...] = (
    LEASES_ACTIVE, PINNED_BLOCKS, EXPIRING_SOON, GRANTS, EXTENSIONS, RELEASES, EXPIRIES, EXPIRED_PEER_RETURNS,
    BINDINGS, HEARTBEAT_UNKNOWN_IDS, ABORTS, LATE_COMPLETIONS, HEARTBEATS_SENT, HEARTBEAT_SEND_FAILURES, HOLD, HEARTBEAT_GAP, RECLAIM_LAG,
    DURATION, HEARTBEAT_INTERVAL, EXTENSION, NOTIFICATIONS_DROPPED, MAX_HOLD,
    READS, READ_VERDICT_WAIT, READ_PROOFS_METRIC, VERDICT_SEND_FAILURES, PLEDGE_HOLD, SPANS_DROPPED,
    HANDSHAKE_LISTENER_UP, HANDSHAKE_REQUESTS, HANDSHAKE_BAD_REQUESTS, PUSH_WRITES_METRIC, PUSH_LATE_WRITES,
    PUSH_WITHHELD,
)
"""Every metric LeaseKitConnector exports, in documentation order."""

VLLM_NIXL_METRICS: dict[str, str] = {
    "vllm:nixl_xfer_time_seconds": "histogram",
    "vllm:nixl_post_time_seconds": "histogram",
    "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_descriptors": "histogram",
    "vllm:nixl_num_failed_transfers": "counter",
    "vllm:nixl_num_failed_notifications": "counter",
    "vllm:nixl_num_kv_expired_reqs": "counter",
    "vllm:nixl_num_notifications_after_expiry": "counter",
}
"""vLLM's own NIXL metrics (vllm 0.32.0 ``nixl/stats.py: NixlPromMetrics``), exported unchanged by
LeaseKitConnector next to ours; name -> kind."""


def exported_series_names() -> frozenset[str]:
    """Every series name a scrape of a LeaseKitConnector server can show for lease/NIXL metrics
    (``_total``, ``_bucket``, ``_sum``, ``_count`` expanded), for checking dashboard and rule queries."""
    names: set[str] = set()
    for spec in LEASEKIT_METRICS:
        names.update(spec.sample_names)
    for name, kind in VLLM_NIXL_METRICS.items():
        names.update(MetricSpec(name, kind, "", (), "both").sample_names)
    return frozenset(names)
