"""Names of the lease span, its events and attributes: the one place they are declared.

The request id uses vLLM's own request-tracing attribute (``gen_ai.request.id``, vllm 0.32.0
``vllm/tracing/utils.py: SpanAttributes.GEN_AI_REQUEST_ID``) so lease spans join request spans.
Times named ``*_monotonic_s`` are seconds on the emitting process's ``time.perf_counter`` (the
clock P's lease deadlines live on); span timestamps themselves are wall-clock nanoseconds.
"""

LEASE_SPAN_NAME = "kv_lease"
"""One span per lease per P worker (TP rank), from grant to its end."""

LATE_READ_SPAN_NAME = "kv_lease_late_read"
"""A zero-length span: a read completion arrived for a lease P had already expired (the read may
have used freed blocks; docs/lease-model.md invariant 5)."""
LATE_WRITE_SPAN_NAME = "kv_lease_late_write"
"""Push mode: a zero-length span for a WRITE of a lease's blocks that finished after the lease ended (P)."""

# Span events, one per lease transition (etcd lessor.go names every transition the same way).
EVENT_GRANT = "grant"
EVENT_EXTEND = "extend"
EVENT_RETRIEVAL = "retrieval"
EVENT_EXPIRE = "expire"
EVENT_RELEASE = "release"
EVENT_ABORT = "abort"

# Outcomes a lease span ends with.
OUTCOME_RELEASED = "released"
OUTCOME_EXPIRED = "expired"
OUTCOME_ABORTED = "aborted"
OUTCOMES = (OUTCOME_RELEASED, OUTCOME_EXPIRED, OUTCOME_ABORTED)

# Span attributes.
REQUEST_ID = "gen_ai.request.id"
ENGINE_ID = "leasekit.engine_id"
KV_ROLE = "leasekit.kv_role"
TP_RANK = "leasekit.tp_rank"
REMOTE_AGENT = "leasekit.remote_agent"
"""The D worker P heard from about the lease: :func:`leasekit.lease.peerref.peer_ref` of its NIXL agent name
(``peer-<12 hex>``), never the name itself (a claim any peer can make). The key keeps its old name so
tools that read it keep working; the value is a reference."""
KV_BLOCKS = "leasekit.kv_blocks"
LEASE_DURATION_S = "leasekit.lease_duration_s"
EXTENSION_S = "leasekit.extension_s"
GRANT_MONOTONIC_S = "leasekit.grant_monotonic_s"
INITIAL_DEADLINE_MONOTONIC_S = "leasekit.initial_deadline_monotonic_s"
DEADLINE_MONOTONIC_S = "leasekit.deadline_monotonic_s"
LAST_EXTEND_MONOTONIC_S = "leasekit.last_extend_monotonic_s"
END_MONOTONIC_S = "leasekit.end_monotonic_s"
EXTEND_COUNT = "leasekit.extend_count"
EXTEND_EVENTS_DROPPED = "leasekit.extend_events_dropped"
RETRIEVALS = "leasekit.retrievals"
OUTCOME = "leasekit.outcome"
EXPIRY_CAUSE = "leasekit.expiry_cause"  # no_heartbeat | heartbeat_lapsed | max_hold (expired leases)
EXPIRY_PEER_STATE = "leasekit.expiry_peer_state"  # heartbeating | silent | unknown (telemetry/peers.py)
ABORT_REASON = "leasekit.abort_reason"
RECLAIM_LAG_S = "leasekit.reclaim_lag_s"
STEP_GAP_S = "leasekit.step_gap_s"
LATE_BY_S = "leasekit.late_by_s"
ENDED_OUTCOME = "leasekit.ended_outcome"

# Event attributes.
EV_MONOTONIC_S = "leasekit.monotonic_s"
EV_DEADLINE_REMAINING_S = "leasekit.deadline_remaining_s"
EV_EXTEND_COUNT = EXTEND_COUNT
EV_RETRIEVALS = RETRIEVALS
EV_REMOTE_AGENT = REMOTE_AGENT

# D side: one span per request D heartbeats for, from tracking (vLLM ``on_new_request``) until D
# stops tracking it (read done, finished or aborted) or the worker shuts down.
HEARTBEATS_SPAN_NAME = "kv_lease_heartbeats"
"""D-side span; carries ``gen_ai.request.id`` = P's request id (the id heartbeats name), so one query
on that attribute joins P's ``kv_lease`` span and D's span for a request."""
DECODE_REQUEST_ID = "leasekit.decode_request_id"
REMOTE_ENGINE_ID = "leasekit.remote_engine_id"
HEARTBEATS_SENT = "leasekit.heartbeats_sent"
FIRST_HEARTBEAT_MONOTONIC_S = "leasekit.first_heartbeat_monotonic_s"
LAST_HEARTBEAT_MONOTONIC_S = "leasekit.last_heartbeat_monotonic_s"
END_REASON = "leasekit.end_reason"
EVENT_TRACKED = "tracked"
EVENT_FIRST_HEARTBEAT = "first_heartbeat"
EVENT_UNTRACKED = "untracked"

# D side: one span per read of P's KV blocks D finished, from the read's end to the read gate's
# decision (leasekit.lease.readgate): held back for P's verdict, then used or discarded.
READ_SPAN_NAME = "kv_lease_read"
"""D-side span; ``gen_ai.request.id`` = P's request id, ``leasekit.read_outcome`` = verified | reaped |
timeout | ungated | unprotected | abandoned | pushed (reaped, timeout and ungated reads were discarded: vLLM's
``kv_load_failure_policy``; abandoned: the request finished on D before the read was decided; pushed: push mode, P
wrote the blocks and there was no read to gate)."""
READ_OUTCOME = "leasekit.read_outcome"
D_FAIL_CLOSED = "leasekit.d_fail_closed"
"""kv_lease_late_read: whether the reading D discards the read (it speaks the fail-closed protocol)."""
READ_VERDICT_WAIT_S = "leasekit.read_verdict_wait_s"
READ_PROOF = "leasekit.read_proof"  # verified reads: verdict | ack | pledge (what proved the lease held)
PLEDGE_UNTIL_MONOTONIC_S = "leasekit.pledge_until_monotonic_s"  # P: the grant pledge's end, worker clock
PLEDGE_HOLD_S = "leasekit.pledge_hold_s"  # P: seconds the blocks stayed pinned after the completion
READ_AGENTS = "leasekit.read_agents"
"""D-side read span: the P agents the read came from, each as :func:`leasekit.lease.peerref.peer_ref` of its
NIXL agent name (never the name; same rule as :data:`REMOTE_AGENT`)."""
READ_DISCARDED_OUTCOMES = ("reaped", "timeout", "ungated")
