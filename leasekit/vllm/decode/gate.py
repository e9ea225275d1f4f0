"""D's side of the fail-closed protocol in LeaseKitConnector's NIXL worker (docs/fail-closed.md).

A read of P's KV blocks becomes tokens only after P confirmed that the lease covered it
(:class:`leasekit.lease.readgate.ReadGate`). :class:`DReadGate` is the component LeaseKit's worker owns
(``_lk_gate``); the worker's hooks of vllm 0.32.0 (``.../kv_connector/v1/nixl/``,
:class:`leasekit.vllm.decode.hooks.DHooks`) hand it these moments:

- ``_read_blocks`` (``pull_worker.py``) -> :meth:`DReadGate.before_read`: before the first read from a P
  agent for a request P marked with ``leasekit_protocol``, say hello to that agent: a heartbeat whose only
  id is ``LK1~H~<base64 "<ZMQ endpoint> <token>">`` (this worker's verdict inbox,
  :mod:`leasekit.vllm.verdictchan`; a stock P ignores an id it does not hold) so that P can answer D; then
  a read probe (a heartbeat naming that lease, whose ack releases the read with no wait if it arrives
  before the read finishes); record which P agents must answer for the request;
- ``_pop_done_transfers`` (``base_worker.py``) for ``_recving_transfers`` -> :meth:`DReadGate.poll`: a
  protected read that finished is held back instead of reported done (its deferred mixed-memory
  completions are sent now, so P hears of it); each step, held reads are decided: ``verified`` ones are
  reported done (and ``abandoned`` ones, whose request already finished on D, so that vLLM frees its
  blocks), ``reaped``, ``timeout`` and ``ungated`` ones are reported failed, so vLLM puts their local
  blocks in ``_invalid_block_ids`` and the scheduler applies ``kv_load_failure_policy`` (``recompute``, or
  a request-level error). Reads of requests P did not mark (stock P) are ``unprotected``: used as stock
  does, and counted (``pushed`` in a push worker, where P WRITEs the blocks and there is no read to gate);
- ``_send_heartbeats`` (``base_worker.py``) -> :meth:`DReadGate.hello_engines`, and each heartbeat's bytes
  through :meth:`DReadGate.sequence_heartbeat` (the NIXL wrapper's tap).

Lease proofs (protocol version 4, :mod:`leasekit.lease.proof`, docs/security.md): for a request whose grant
carried a lease secret ``T``, its heartbeat ids become ``<id>~<heartbeat tag>``, its read completions
``<id>~<completion tag>:<n>`` (:meth:`DReadGate.proved_read`) and D's hello to its P engine carries a hello tag;
requests of a stock or pre-4 P stay plain. Logs and spans name a P agent by its
:func:`~leasekit.lease.peerref.peer_ref`, never by its name.

Every decision is a ``kv_lease_read`` span, a ``leasekit_kv_lease_reads_total{outcome}`` increment
(with the wait in ``leasekit_kv_lease_read_verdict_wait_seconds``) and, for discarded reads, a
rate-limited WARNING. A failure of this code never raises into the engine loop: a read it could not
gate is reported failed (fail closed), not served.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from leasekit.lease.codec import (
    REASON_BAD_PROTOCOL,
    Ack,
    Verdict,
    decode_notification,
    encode_hello,
    sequence_token,
)
from leasekit.lease.peerref import peer_ref
from leasekit.lease.pledge import parse_pledge
from leasekit.lease.proof import TAG_SEPARATOR, completion_tag, hello_tag, parse_secret
from leasekit.lease.readgate import (
    OUTCOME_ABANDONED,
    OUTCOME_TIMEOUT,
    OUTCOME_UNPROTECTED,
    RELEASED_OUTCOMES,
    USE,
    GateResult,
    ReadGate,
    agent_name,
)
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.decode.heartbeats import DLeaseSecrets
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.kvdigest import KV_DIGEST_ATTR
from leasekit.vllm.taps import HEARTBEAT_PREFIX, MAX_HEARTBEAT_CHUNK_BYTES, WireHeartbeat
from leasekit.vllm.verdictchan import MAX_MESSAGE_BYTES, VerdictInbox, encode_hello_payload

MAX_ENGINE_HOSTS = 4096
"""P engines whose side-channel host D remembers (the oldest are forgotten first)."""
SEQUENCE_ROOM_BYTES = 32
"""Bytes a heartbeat part keeps free for its ``,LK1~<n>`` sequence token (``n``: at most 20 digits)."""
PROOF_VERSION = 4
"""Lowest ``leasekit_protocol`` marker whose grant's lease secret D proves (older P: plain ids)."""

DropFn = Callable[[str, str, str], None]
"""``drop(reason, agent, detail)``: count (and log) one dropped message; ``reason`` is a label of
``leasekit_notifications_dropped_total`` (here ``bad_protocol``), ``agent`` the sender or ``"?"``."""


class DReadGate:
    """D's read gate: holds each finished KV read of a protected request until P proved the lease covered
    it, and reports it done or failed to vLLM.

    Args:
        state: vLLM's worker state (:class:`leasekit.vllm.decode.vllmstate.VllmDState`): remote agents, the
            receive maps, ``_send_pending_recv_notifs``, the NIXL wrapper, the TP rank.
        timeout_s: seconds a held read waits for P's verdict before it is discarded (``timeout``); > 0
            (``leasekit_verdict_timeout_s``, checked by :func:`leasekit.lease.settings.verdict_timeout`).
        lease_duration_s: L, seconds; the largest remaining lease time an ack may claim.
        tracer: OpenTelemetry tracer for the ``kv_lease_read`` spans.
        stats: :class:`leasekit.vllm.stats.LeaseStatsObserver` (``read(outcome, wait_s, proof)``).
        errors: :class:`leasekit.vllm.taps.TelemetryErrors` (``report(where, exc)``; never raises).
        faults: :class:`leasekit.vllm.faultpoints.FaultPoints` (``enabled``, ``heartbeats_disturbed()``).
        drop: ``drop(reason, agent, detail)`` for junk in the verdict inbox (:data:`DropFn`).
        context_of: P request id -> the OpenTelemetry context of its request's trace, or None
            (:meth:`leasekit.telemetry.decode_spans.HeartbeatSpanRecorder.context_of`).
        warning: rate-limited WARNING for discarded reads (default: one on the lease logger).

    It opens this worker's verdict inbox (:attr:`inbox`, bound lazily per P host); :meth:`close` closes it.

    Raises:
        ValueError: ``timeout_s`` not > 0 (from :class:`leasekit.lease.readgate.ReadGate`).
    """

    def __init__(self, state: VllmDState, *, timeout_s: float, lease_duration_s: float, tracer: Any, stats: Any,
                 errors: Any, faults: Any, drop: DropFn, context_of: Callable[[str], Any],
                 warning: RateLimitedWarning | None = None):
        self.gate = ReadGate(timeout_s, max_remaining_s=lease_duration_s)
        """The decisions (:class:`leasekit.lease.readgate.ReadGate`), pure; this component drives it."""
        self._state = state
        self._tracer = tracer
        self._stats = stats
        self._errors = errors
        self._faults = faults
        self._drop = drop
        self._context_of = context_of
        self._warning = warning if warning is not None else RateLimitedWarning(lease_logger())
        self.unmarked_outcome = OUTCOME_UNPROTECTED  # of a read P did not mark; a push worker's: OUTCOME_PUSHED
        self.inbox = VerdictInbox()
        """This worker's verdict inbox (:class:`leasekit.vllm.verdictchan.VerdictInbox`)."""
        self.hello_sent: set[str] = set()
        """Names of the P agents that heard our hello (and so ack our sequenced heartbeats)."""
        self._hello_msgs: dict[tuple, tuple[str, bytes]] = {}  # (P host, proof or None) -> (inbox endpoint, hello)
        self.secrets = DLeaseSecrets(max_engines=MAX_ENGINE_HOSTS)
        """Lease secrets of the live protected requests (:class:`leasekit.vllm.decode.heartbeats.DLeaseSecrets`)."""
        self._engine_hosts: dict[str, str] = {}  # P engine id -> its side-channel host
        self._read_digests: dict[str, str] = {}  # only with fault points (kvdigest.py)
        self._protocol_engines: dict[str, None] = {}  # P engine ids that speak the protocol (most recent last)

    def close(self) -> None:
        """Close the verdict inbox (worker shutdown)."""
        self.inbox.close()

    def protect(self, marked: Any) -> None:
        """Requests P marked with ``leasekit_protocol``: ``[D request id, P engine id, P host, pledge, P request
        id, lease secret, marker]`` from the scheduler's metadata (an older scheduler sends the first 2 to 4;
        pledge: ``[until_us, clock id]`` or None, leasekit/lease/pledge.py; secret: 32 hex digits or None,
        :func:`leasekit.lease.proof.parse_secret`; marker: P's ``leasekit_protocol`` int). That P engine speaks
        the protocol: D may say hello to it, naming the inbox endpoint its kernel routes to that host from. A
        valid secret with marker >= :data:`PROOF_VERSION` is kept (:attr:`secrets`) until :meth:`finish`.
        None: nothing."""
        for request_id, engine_id, *rest in marked or ():
            host = rest[:1]
            self.gate.protect(request_id, parse_pledge(rest[1]) if len(rest) > 1 else None)
            if len(rest) >= 5 and isinstance(rest[4], int) and rest[4] >= PROOF_VERSION and isinstance(rest[2], str) \
                    and rest[2] and (secret := parse_secret(rest[3])) is not None:
                self.secrets.add(request_id, str(engine_id or ""), rest[2], secret)
            if engine_id:
                engines = self._protocol_engines  # bounded: engine ids come from request parameters
                engines.pop(str(engine_id), None)
                engines[str(engine_id)] = None
                if len(engines) > MAX_ENGINE_HOSTS:
                    del engines[next(iter(engines))]
                if host and host[0]:
                    self._engine_hosts.pop(str(engine_id), None)  # most recent last
                    self._engine_hosts[str(engine_id)] = str(host[0])
                    if len(self._engine_hosts) > MAX_ENGINE_HOSTS:
                        del self._engine_hosts[next(iter(self._engine_hosts))]

    def finish(self, request_ids: Iterable[str] | None) -> None:
        """Protected requests that finished on D (scheduler's ``request_finished``: served, aborted or
        failed): their gate state ends (an undecided read of theirs will never be served)."""
        for request_id in request_ids or ():
            self.gate.finish(request_id)
            self.secrets.finish(request_id)
            self._read_digests.pop(request_id, None)

    def receive_verdicts(self) -> None:
        """Hand every verdict and acknowledgement waiting in the inbox to the gate; anything else there
        is dropped and counted (``bad_protocol``). Called each step before held reads are decided.
        Raises what the inbox or ``drop`` raise (:meth:`poll` reports it)."""
        received, malformed = self.inbox.drain()
        for _ in range(malformed):
            self._drop(REASON_BAD_PROTOCOL, "?", "verdict inbox: not [P agent name, message]")
        for agent, raw in received:
            message = decode_notification(raw, max_bytes=MAX_MESSAGE_BYTES)
            if isinstance(message, Verdict):
                self.gate.verdict(agent, message.req_id, message.ok)
            elif isinstance(message, Ack):
                self.gate.ack(agent, message.seq, message.remaining_s, message.req_ids, message.remote_now_s,
                              message.clock_id)
            else:
                self._drop(REASON_BAD_PROTOCOL, agent, "verdict inbox: neither a verdict nor an ack")

    def hello_engines(self, heartbeat_by_engine: Any) -> None:
        """Before heartbeating a P engine known to speak the protocol (handshake done), say hello to its
        agents, so that P acknowledges these heartbeats (the gate's fast path). ``heartbeat_by_engine``:
        vLLM's metadata field (P engine id -> heartbeat info), or None. Never raises."""
        for engine_id in heartbeat_by_engine or ():
            try:
                remote_agents = self._state.remote_agents
                if (engine_id in self._protocol_engines and engine_id in remote_agents
                        and engine_id in self._engine_hosts):
                    for agent in remote_agents[engine_id].values():
                        self._say_hello(agent, engine_id)
            except Exception as exc:  # acks are an optimisation: without them D waits for verdicts
                self._errors.report("hello", exc)

    def sequence_heartbeat(self, agent: Any, msg: bytes, started_s: float) -> bytes | list[WireHeartbeat]:
        """What goes on the wire to ``agent`` for heartbeat ``msg`` (begun at ``started_s``, ``perf_counter``
        seconds); the NIXL wrapper tap's ``rewrite``. Each id whose lease has a secret becomes
        ``<id>~<heartbeat tag>`` (others stay plain); a heartbeat over :data:`MAX_HEARTBEAT_CHUNK_BYTES` is
        split into complete heartbeats within it; when the agent heard our hello, each notification gets
        ``,LK1~<n>``, its own ``n`` (:meth:`ReadGate.heartbeat_sent`, all dated ``started_s``, no later than any
        part's send, so an ack's horizon stays conservative), so that P's ack names that send. Returns bytes
        for one notification (``msg`` itself when unchanged), else a list of
        :class:`~leasekit.vllm.taps.WireHeartbeat`. Never raises (the stock bytes on failure)."""
        try:
            name = agent_name(agent)
            sequenced = name in self.hello_sent
            parts = self.secrets.wire_heartbeats(msg, MAX_HEARTBEAT_CHUNK_BYTES - SEQUENCE_ROOM_BYTES * sequenced)
            if parts is None:
                if not sequenced:
                    return msg
                parts = [WireHeartbeat(bytes(msg), bytes(msg))]
            if sequenced:
                tokens = [sequence_token(self.gate.heartbeat_sent(name, started_s)).encode() for _ in parts]
                parts = [WireHeartbeat(p.wire + b"," + t, p.original) for p, t in zip(parts, tokens)]
            return parts[0].wire if len(parts) == 1 else parts
        except Exception as exc:  # acks are an optimisation: send the stock heartbeat
            self._errors.report("heartbeat sequence", exc)
            return msg

    def before_read(self, args: tuple, kwargs: dict) -> None:
        """Called with ``_read_blocks``' arguments just before vLLM posts the read: for a protected
        request, the expectation of that P agent's verdict, then the hello (once per P agent), then the
        probe. If either of the first two fails the read is ``ungated`` (discarded). vLLM 0.32 passes
        every argument by keyword (``pull_worker.py`` ``_read_and_notify``); positional arguments make
        every protected read ``ungated`` rather than unchecked. Never raises."""
        request_id = kwargs.get("request_id")
        if args and request_id is None:
            self.gate.ungate_all()
        if request_id is not None and self.gate.is_protected(request_id):
            try:
                spec, engine = kwargs["read_spec"], kwargs["dst_engine_id"]
                agent = self._state.remote_agents[engine][(0, spec.remote_rank)]
                self.gate.expect(request_id, agent_name(agent), kwargs["remote_request_id"])
                self._say_hello(agent, engine, kwargs["remote_request_id"])
            except Exception as exc:  # fail closed: this read will be discarded, never served unchecked
                self.gate.ungate(request_id)
                self._errors.report("read gate", exc)
            else:
                self._probe(agent, kwargs["remote_request_id"])

    def proved_read(self, kwargs: dict) -> dict:
        """``_read_blocks``' keyword arguments for the stock call (after :meth:`before_read`): when the lease of
        ``remote_request_id`` has a secret, a copy whose ``remote_request_id`` is ``<id>~<completion tag for
        expected_consumers>``, so that vLLM's completion reads ``<id>~<tag>:<n>``
        (:func:`leasekit.lease.proof.completion_tag`); otherwise ``kwargs`` itself. If the tag cannot be made
        the read is ``ungated`` (fail closed) and ``kwargs`` returned. Never raises."""
        remote = kwargs.get("remote_request_id")
        secret = self.secrets.secret(remote) if isinstance(remote, str) else None
        if secret is None:
            return kwargs
        try:
            tag = completion_tag(secret, kwargs["expected_consumers"])
        except Exception as exc:  # fail closed: P would not count a plain completion of this lease
            if kwargs.get("request_id") is not None:
                self.gate.ungate(kwargs["request_id"])
            self._errors.report("completion proof", exc)
            return kwargs
        return {**kwargs, "remote_request_id": f"{remote}{TAG_SEPARATOR}{tag}"}

    def _probe(self, agent: Any, remote_request_id: str) -> None:
        """A heartbeat naming this one lease, sent just before its read is posted (with the sequence
        token, :meth:`sequence_heartbeat`). P's acknowledgement travels while the read runs, so a
        read of a comfortably alive lease finds it already covered if the ack beat the read, and passes
        with no wait (the fast path) instead of waiting up to a round trip for its verdict. An optimisation
        only: a failed send is reported, never fatal. Not sent while a chaos heartbeat fault is set."""
        try:
            if self._faults.enabled and self._faults.heartbeats_disturbed():
                return
            self._state.nixl_wrapper.send_notif(agent, notif_msg=HEARTBEAT_PREFIX + str(remote_request_id).encode())
        except Exception as exc:
            self._errors.report("read probe", exc)

    def _say_hello(self, agent: str | bytes, engine_id: str, remote_request_id: str | None = None) -> None:
        """Tell P agent ``agent`` (of P engine ``engine_id``) where to send its verdicts, once. To an engine that
        granted D a lease secret, the hello proves one (version 4): that of ``remote_request_id`` (the lease
        being read) if it has one, else the engine's latest (:meth:`DLeaseSecrets.hello_proof`); else the old
        ``<endpoint> <token>`` hello.

        Raises:
            KeyError: D does not know that engine's host (its request was not marked).
            OSError, zmq.ZMQError: no route to that host, or the inbox could not bind.
        """
        if agent_name(agent) in self.hello_sent:
            return
        host = self._engine_hosts[str(engine_id)]
        proof = self.secrets.hello_proof(str(engine_id), remote_request_id)
        hello = self._hello_msgs.get((host, proof))
        if hello is None:
            if len(self._hello_msgs) >= MAX_ENGINE_HOSTS:
                self._hello_msgs.clear()
            endpoint, token = self.inbox.endpoint_for(host), self.inbox.token
            proved = () if proof is None else (proof[0], hello_tag(proof[1], endpoint, token))
            payload = encode_hello_payload(endpoint, token, *proved)
            hello = self._hello_msgs[(host, proof)] = (endpoint, encode_hello(payload))
        wrapper = self._state.nixl_wrapper
        raw = getattr(wrapper, "_wrapped", wrapper)  # not counted as a heartbeat
        raw.send_notif(agent, notif_msg=hello[1])
        self.hello_sent.add(agent_name(agent))
        lease_logger().info("LeaseKit: said hello to P agent %s (verdicts to %s%s): reads from it wait for its "
                            "verdicts", peer_ref(agent), hello[0], "" if proof is None else ", with a lease proof")

    def poll(self, transfers: Any, done: set[str], failed: set[str]) -> tuple[set[str], set[str]]:
        """After vLLM's stock ``_pop_done_transfers(transfers)`` returned ``(done, failed)`` (D request ids):
        for the receive map (``transfers`` is ``_recving_transfers``), finished protected reads are held
        back, and held reads P answered (or that timed out) are reported done (verified; abandoned: the
        request already finished on D) or failed (reaped, timeout, ungated). Any other map: unchanged.
        Returns the (possibly updated) ``(done, failed)`` sets. A failure inside the gate is reported, not
        raised, and fails the read it concerns (never serves it); only a missing vLLM attribute raises."""
        if transfers is not self._state.recving_transfers:
            return done, failed
        try:
            self.receive_verdicts()
        except Exception as exc:  # held reads then wait (and time out): never served unchecked
            self._errors.report("verdict inbox", exc)
        now = time.perf_counter()
        decided: list[GateResult] = []
        for request_id in list(done):
            if request_id in failed or request_id in self._state.recv_failures:
                continue  # stock failure handling (vLLM invalidates the blocks)
            try:
                if self._faults.enabled:
                    self._digest_read(request_id)
                action = self.gate.hold(request_id, now)
                if action != USE:  # HOLD, or FAIL (decided ungated by resolve below)
                    done.discard(request_id)
                    self._state.send_pending_recv_notifs(request_id)  # mixed-memory reads notify P only now
                else:
                    meta = self._state.recving_metadata.get(request_id)
                    remote = getattr(getattr(meta, "remote", None), "request_id", "")
                    outcome = OUTCOME_ABANDONED if self.gate.pop_finished(request_id) else self.unmarked_outcome
                    decided.append(GateResult(request_id, remote, outcome, 0.0))
            except Exception as exc:  # fail closed: a read we could not gate is not served
                self._errors.report("read gate", exc)
                done.discard(request_id)
                failed.add(request_id)
        try:
            for result in self.gate.resolve(now):
                if result.outcome in RELEASED_OUTCOMES:  # verified, or abandoned: vLLM frees its blocks
                    done.add(result.request_id)
                else:
                    failed.add(result.request_id)
                decided.append(result)
            for result in decided:
                self._record_read(result, now)
        except Exception as exc:
            self._errors.report("read gate", exc)
        return done, failed

    def _digest_read(self, request_id: str) -> None:
        meta = self._state.recving_metadata.get(request_id)
        groups = getattr(meta, "local_block_ids", None)
        if groups is not None and len(groups) and len(groups[0]):
            self._read_digests[request_id] = self._state.kv_digest([int(b) for b in groups[0]]) or ""

    def _discard_reason(self, outcome: str) -> str:
        if outcome == "reaped":
            return "P had already ended the lease"
        if outcome == OUTCOME_TIMEOUT:
            return ("no verdict from P in time (P down, partitioned or idle, or P cannot open a TCP connection to "
                    f"this worker's verdict inbox {', '.join(self.inbox.endpoints) or '(none bound)'})")
        return "the read could not be checked (a repeated read of that P request, or the gate's hook failed)"

    def _record_read(self, result: GateResult, now: float) -> None:
        self._stats.read(result.outcome, result.wait_s, result.proof)
        if result.outcome == OUTCOME_TIMEOUT:  # P may have closed this D's agent (cap, restart), or D's address
            # changed: route again, and say hello again (P reconnects if the endpoint changed or it forgot us)
            self.hello_sent.difference_update(agent_name(a) for a in result.agents)
            self._hello_msgs.clear()
            self.inbox.forget_routes()
        digest = self._read_digests.pop(result.request_id, None)
        start_ns = time.time_ns() - int(result.wait_s * 1e9)
        parent = self._context_of(result.remote_request_id)  # the request's trace, if D tracks it
        span = self._tracer.start_span(sc.READ_SPAN_NAME, context=parent, start_time=start_ns, attributes={
            sc.REQUEST_ID: result.remote_request_id,
            sc.DECODE_REQUEST_ID: result.request_id,
            sc.TP_RANK: self._state.tp_rank,
            sc.READ_OUTCOME: result.outcome,
            sc.READ_VERDICT_WAIT_S: result.wait_s,
            sc.READ_AGENTS: [peer_ref(a) for a in result.agents],
            sc.EV_MONOTONIC_S: now,
            **({sc.READ_PROOF: result.proof} if result.proof else {}),
            **({KV_DIGEST_ATTR: digest} if digest is not None else {}),
        })
        span.end()
        if result.outcome in sc.READ_DISCARDED_OUTCOMES:
            self._warning.warn(
                "LeaseKit: discarded the KV read of request %s (P request %s): %s after %.3f s; vLLM's "
                "kv_load_failure_policy applies (recompute, or the request fails)",
                result.request_id, result.remote_request_id,
                self._discard_reason(result.outcome),
                result.wait_s, event="read_discarded", request_id=result.remote_request_id, outcome=result.outcome,
            )
