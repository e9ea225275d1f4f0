"""D's read gate: a read of P's KV blocks becomes tokens only after P confirmed the lease covered it.

Pure logic (no vLLM, no NIXL), driven by LeaseKitConnector's D worker (:mod:`leasekit.vllm.decode.gate`).
The rule (docs/fail-closed.md): NIXL delivers D's completion ``<id>:<n>`` to P only after D's READ
finished, and P frees a lease's blocks only in the engine loop that also handles notifications. So if
the lease is still live when P handles the completion, no block was freed (or reused) during the read,
and P answers ``LK1:V:ok:<id>``; otherwise ``LK1:V:reaped:<id>``. D holds each protected read back until
every P agent it read from answered ``ok`` (or, fast path, while P's heartbeat acknowledgements already
prove every lease it read live past the moment D saw the read finish: no wait); ``reaped`` from any, or
no answer within ``timeout_s``
(P dead, partitioned, or its loop stalled longer than a lease), fails the read so that vLLM applies its
``kv_load_failure_policy`` (vllm 0.32.0 ``base_worker.py`` ``_invalid_block_ids``). Fast paths, no wait:
the ack horizon (above) and the grant's pledge (leasekit/lease/pledge.py: P frees none of the grant's
blocks before a time on its clock, which D bounds from acks' clock samples with a 10 % rate error).

Outcomes (a closed set, fit for a metric label): ``verified`` (every P agent said ok), ``reaped``
(P said the lease had ended: the read was discarded), ``timeout`` (no verdict in time: discarded),
``ungated`` (a protected read the gate could not check: its hook failed, or another read of the same
P request by this worker is undecided or already ended: discarded), ``unprotected`` (P did
not mark the request with ``leasekit_protocol``: a stock P; the read is used as stock vLLM does, and only
counted), ``abandoned`` (the request finished on D, e.g. a client abort, before its read was decided: the
read is reported done only so that vLLM frees the request's blocks; no tokens come of it), ``pushed`` (push mode:
P WRITEs the blocks into D, so there is no read to gate; reported done and counted).

Threat model: verdicts and acknowledgements are trusted as coming from the P agent they name (the first
frame of a ZMQ message, leasekit/vllm/verdictchan.py), so a peer that can reach D's verdict inbox could
forge them; the gate bounds what a forged ack can claim (at most ``L``) and starts
its sequence numbers at a random value, but it is not an authenticated protocol.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Callable

from leasekit.lease.pledge import RATE_FACTOR, Pledge, RemoteClockBound

OUTCOME_VERIFIED = "verified"
OUTCOME_REAPED = "reaped"
OUTCOME_TIMEOUT = "timeout"
OUTCOME_UNGATED = "ungated"
OUTCOME_UNPROTECTED = "unprotected"
OUTCOME_ABANDONED = "abandoned"
OUTCOME_PUSHED = "pushed"
"""A push-mode D's WRITE received: P wrote the blocks, D read nothing, so there is no read to gate."""
READ_OUTCOMES = (OUTCOME_VERIFIED, OUTCOME_REAPED, OUTCOME_TIMEOUT, OUTCOME_UNGATED, OUTCOME_UNPROTECTED,
                 OUTCOME_ABANDONED, OUTCOME_PUSHED)
"""Every outcome of :class:`ReadGate` (``leasekit_kv_lease_reads_total{outcome}``)."""
DISCARDED_OUTCOMES = (OUTCOME_REAPED, OUTCOME_TIMEOUT, OUTCOME_UNGATED)
"""Outcomes whose read was reported failed to vLLM (``kv_load_failure_policy`` applied)."""
RELEASED_OUTCOMES = (OUTCOME_VERIFIED, OUTCOME_ABANDONED, OUTCOME_UNPROTECTED, OUTCOME_PUSHED)
"""Outcomes whose read is reported done to vLLM: used (verified, unprotected), or, for a request that
already finished on D (``abandoned``), only so that vLLM frees its blocks: vllm 0.32.0
``Scheduler.finish_requests`` delays freeing a ``WAITING_FOR_REMOTE_KVS`` request's blocks until the
worker reports its receive finished."""

PROOF_PLEDGE, PROOF_ACK, PROOF_VERDICT = "pledge", "ack", "verdict"
READ_PROOFS = (PROOF_PLEDGE, PROOF_ACK, PROOF_VERDICT)
"""What proved a ``verified`` read (``leasekit_kv_lease_read_proofs_total{proof}``): the grant's pledge
(leasekit/lease/pledge.py), a heartbeat acknowledgement's horizon, or P's verdict on the completion."""

HOLD, USE, FAIL = "hold", "use", "fail"
"""What :meth:`ReadGate.hold` tells D to do with a finished read."""

MAX_SENT_HEARTBEATS = 256
"""Heartbeat send instants remembered per P agent, awaiting that agent's acknowledgements."""

MAX_KEYS = 65536
"""Horizons and recently ended reads remembered (the oldest are forgotten beyond this)."""


def agent_name(agent: str | bytes) -> str:
    """A NIXL agent name as ``str`` (vLLM keeps the names ``add_remote_agent`` returned, which are
    ``bytes``; ``get_new_notifs`` keys are ``str``)."""
    return agent.decode("utf-8", "replace") if isinstance(agent, (bytes, bytearray)) else str(agent)


@dataclass
class GateResult:
    """One read the gate decided. ``request_id``: D's request id; ``remote_request_id``: P's;
    ``outcome``: one of :data:`READ_OUTCOMES`; ``wait_s``: seconds D held the read back (0 for
    ``unprotected``); ``agents``: the P agents it read from; ``proof``: for ``verified``, one of
    :data:`READ_PROOFS`, else None."""

    request_id: str
    remote_request_id: str
    outcome: str
    wait_s: float
    agents: tuple[str, ...] = ()
    proof: str | None = None


@dataclass
class _Read:
    remote_request_id: str = ""
    agents: set[str] = field(default_factory=set)
    held_since: float | None = None
    ungated: bool = False
    abandoned: bool = False  # the request finished on D while its read was held
    verdicts: dict[str, bool] = field(default_factory=dict)  # agent -> ok (a reaped is never overwritten)


def _bounded(mapping: dict, limit: int = MAX_KEYS) -> None:
    while len(mapping) > limit:
        del mapping[next(iter(mapping))]


class ReadGate:
    """Per-request state of D's protected reads.

    Args:
        timeout_s: seconds to wait for P's verdicts after the read finished (> 0); default of the
            connector: ``min(L, 600)`` (P's loop handles notifications at least every ``L`` while it
            holds leases, or the lease would expire anyway).
        max_remaining_s: the most an acknowledgement may claim is left on a lease, seconds (D's ``L``:
            a heartbeat never leaves more than ``max(L, E) = L``); larger claims are cut to it.
        clock: seconds (``time.perf_counter``).

    Raises:
        ValueError: ``timeout_s`` or ``max_remaining_s`` is not > 0.
    """

    def __init__(self, timeout_s: float, max_remaining_s: float = 3600.0, clock: Callable[[], float] = time.perf_counter):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0 seconds")
        if not max_remaining_s > 0:
            raise ValueError(f"max_remaining_s={max_remaining_s!r}: must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self.max_remaining_s = float(max_remaining_s)
        self._clock = clock
        self._reads: dict[str, _Read] = {}
        self._protected: set[str] = set()
        self._finished: dict[str, None] = {}  # protected requests that finished on D before their read did
        self._owner: dict[tuple[str, str], str] = {}  # (agent, P request id) -> the D request reading it
        self._ended: dict[tuple[str, str], float] = {}  # (agent, P request id) -> when its read ended
        self._sent: dict[str, dict[int, float]] = {}  # P agent -> {heartbeat seq: send instant}, unacked
        self._seq = secrets.randbits(48)  # not guessable by a peer that forges acks
        self._horizon: dict[tuple[str, str], float] = {}  # (agent, P request id) -> held at least until
        self._clocks = RemoteClockBound()  # P clocks, sampled by acks (the pledge's fast path)
        self._pledges: dict[str, Pledge] = {}  # D request id -> its grant's pledge, while protected

    def protect(self, request_id: str, pledge: Pledge | None = None) -> None:
        """P marked ``request_id`` (D's id) with ``leasekit_protocol``: its read will wait for verdicts,
        unless ``pledge`` (the grant's, leasekit/lease/pledge.py) provably still held when D saw it finish.
        It stays protected until decided or :meth:`forget` (the request finished on D)."""
        self._protected.add(request_id)
        if pledge is not None:
            self._pledges[request_id] = pledge

    def is_protected(self, request_id: str) -> bool:
        """Whether ``request_id`` is protected (see :meth:`protect`)."""
        return request_id in self._protected

    def expect(self, request_id: str, agent: str, remote_request_id: str, now: float | None = None) -> None:
        """D is about to post a read of ``remote_request_id`` from P agent ``agent``: that agent must
        answer. A second read of the same P request from the same agent, undecided or ended (among the
        last :data:`MAX_KEYS` ended ones), is ``ungated``: this worker's completion of the first read
        counted towards freeing the lease, and a verdict queued for the first read may still arrive at
        any time. ``now`` is accepted for symmetry with the other calls and not used."""
        read = self._reads.setdefault(request_id, _Read())
        read.remote_request_id = remote_request_id
        read.agents.add(agent)
        key = (agent, remote_request_id)
        owner = self._owner.get(key)
        ended = self._ended.get(key)
        if (owner is not None and owner != request_id) or ended is not None:
            read.ungated = True
            return
        self._owner[key] = request_id

    def finish(self, request_id: str, now: float | None = None) -> None:
        """``request_id`` finished on D (served, aborted or failed): its state is dropped. A finished
        request produces no more tokens, so a read of it needs no gate (a full prefix-cache hit, which
        vLLM may never report as received, would otherwise stay here). A read held at that moment is
        still decided, as ``abandoned``, by the next :meth:`resolve` (vLLM frees the request's blocks
        only once the worker reports the receive finished); a protected read still in flight is
        ``abandoned`` too when it finishes (see :meth:`pop_finished`)."""
        read = self._reads.get(request_id)
        if read is not None and read.held_since is not None:
            read.abandoned = True
            self._protected.discard(request_id)
            return
        if request_id in self._protected and request_id in self._reads:  # its read was posted, not yet done
            self._finished[request_id] = None
            _bounded(self._finished)
        self.forget(request_id, now)

    def pop_finished(self, request_id: str) -> bool:
        """Whether ``request_id`` was protected and finished on D before its read finished (forgotten
        once asked): that read, reported done, is ``abandoned``, not ``unprotected``."""
        return self._finished.pop(request_id, False) is None

    def ungate_all(self) -> None:
        """Every protected request's read is ``ungated`` (the hook could not tell which read it saw)."""
        for request_id in self._protected:
            self.ungate(request_id)

    def ungate(self, request_id: str) -> None:
        """The read of ``request_id`` could not be gated (a hook failed): it will be discarded."""
        self._reads.setdefault(request_id, _Read()).ungated = True

    def hold(self, request_id: str, now: float | None = None) -> str:
        """The read of ``request_id`` finished on D: :data:`USE` it now (not protected), :data:`HOLD` it
        for verdicts, or :data:`FAIL` it (protected, but no P agent is expected to answer: decided
        ``ungated`` by the next :meth:`resolve`)."""
        if request_id not in self._protected:
            return USE
        read = self._reads.setdefault(request_id, _Read())
        if not read.agents:
            read.ungated = True
        if read.held_since is None:
            read.held_since = self._clock() if now is None else now
        return FAIL if read.ungated else HOLD

    def heartbeat_sent(self, agent: str, now: float | None = None) -> int:
        """D is about to send a heartbeat to P agent ``agent``; returns its sequence number (sent as the
        ``LK1~<n>`` token, echoed in P's acknowledgement). ``now``: when the send begins, seconds."""
        self._seq += 1
        sent = self._sent.setdefault(agent, {})
        sent[self._seq] = self._clock() if now is None else now
        _bounded(sent, MAX_SENT_HEARTBEATS)  # never acknowledged (lost): forgetting it loses nothing
        return self._seq

    def ack(self, agent: str, seq: int, remaining_s: float, remote_request_ids: Iterable[str],
            remote_now_s: float | None = None, clock_id: str | None = None, now: float | None = None) -> None:
        """P acknowledged heartbeat ``seq`` of ``agent``: each lease was live with ``remaining_s``
        seconds to go (cut to ``max_remaining_s``); P's clock ``clock_id`` read ``remote_now_s`` then.

        Matched by sequence number to the instant D began that send (no later than P read it), so the
        horizon ``send + remaining_s / K`` (``K``: :data:`leasekit.lease.pledge.RATE_FACTOR`, the clocks' rate
        error) is never later than P's deadline, and ``(send, remote_now_s)`` is a
        sample of P's clock (:class:`leasekit.lease.pledge.RemoteClockBound`; ``now``: when D received the
        ack, default this gate's clock). An ack for a send D does not know (forged, replayed, or forgotten)
        is ignored."""
        started = self._sent.get(agent, {}).pop(seq, None)
        if started is None:
            return
        if clock_id is not None and remote_now_s is not None:
            self._clocks.add_sample((agent, clock_id), started, float(remote_now_s), self._clock() if now is None else now)
        # P's remaining seconds elapse in no less than remaining / K of D's (leasekit/lease/pledge.py)
        horizon = started + min(float(remaining_s), self.max_remaining_s) / RATE_FACTOR
        for rid in remote_request_ids:
            key = (agent, rid)
            if horizon > self._horizon.get(key, float("-inf")):
                self._horizon[key] = horizon
        _bounded(self._horizon)

    def verdict(self, agent: str, remote_request_id: str, ok: bool) -> None:
        """P agent ``agent`` answered for ``remote_request_id``. Kept only for the read that owns that
        (agent, P request) now; a reaped answer is never overwritten."""
        owner = self._owner.get((agent, remote_request_id))
        read = self._reads.get(owner) if owner is not None else None
        if read is None or read.ungated:
            return
        read.verdicts[agent] = read.verdicts.get(agent, True) and ok

    def resolve(self, now: float | None = None) -> list[GateResult]:
        """Decide every held read that can be decided now (each is forgotten once decided)."""
        now = self._clock() if now is None else now
        decided = []
        for request_id, read in list(self._reads.items()):
            if read.held_since is None:
                continue
            answers = [read.verdicts.get(agent) for agent in read.agents]
            proof = None
            if read.abandoned:
                outcome = OUTCOME_ABANDONED
            elif read.ungated:
                outcome = OUTCOME_UNGATED
            elif any(answer is False for answer in answers):
                outcome = OUTCOME_REAPED
            elif (proof := self._proof(request_id, read, answers)) is not None:
                outcome = OUTCOME_VERIFIED
            elif now - read.held_since >= self.timeout_s:
                outcome = OUTCOME_TIMEOUT
            else:
                continue
            decided.append(GateResult(request_id, read.remote_request_id, outcome, max(0.0, now - read.held_since),
                                      tuple(sorted(read.agents)), proof))
            self.forget(request_id, now)
        return decided

    def _proof(self, request_id: str, read: _Read, answers: list[bool | None]) -> str | None:
        """What proves ``read`` (held, no ``reaped`` answer) was of live blocks, or None yet. The pledge
        and ack horizons are checked at ``held_since``, the instant D saw the read finish."""
        pledge = self._pledges.get(request_id)
        if pledge is not None and self._clocks.covers(pledge, read.held_since,
                                                      [(agent, pledge.clock_id) for agent in read.agents]):
            return PROOF_PLEDGE
        if all(self._horizon.get((agent, read.remote_request_id), float("-inf")) >= read.held_since
               for agent in read.agents):
            return PROOF_ACK
        if all(answer is True for answer in answers):
            return PROOF_VERDICT
        return None

    def forget(self, request_id: str, now: float | None = None) -> None:
        """Drop everything about ``request_id`` (decided, or finished on D: aborted, failed). Its
        (agent, P request) keys are remembered as ended (the last :data:`MAX_KEYS` of them): a later
        read of one is ``ungated`` (:meth:`expect`)."""
        now = self._clock() if now is None else now
        read = self._reads.pop(request_id, None)
        self._protected.discard(request_id)
        self._pledges.pop(request_id, None)
        if read is None:
            return
        for agent in read.agents:
            key = (agent, read.remote_request_id)
            if self._owner.get(key) == request_id:
                del self._owner[key]
                self._horizon.pop(key, None)
                self._ended[key] = now
        _bounded(self._ended)

    @property
    def held(self) -> int:
        """How many reads are held back waiting for verdicts."""
        return sum(1 for read in self._reads.values() if read.held_since is not None)
