"""D's read gate: a read of P's KV blocks becomes tokens only after P confirmed the lease covered it.

Pure logic (no vLLM, no NIXL), driven by LeaseKitConnector's D worker (:mod:`leasekit.vllm.dgate`).
The rule (docs/fail-closed.md): NIXL delivers D's completion ``<id>:<n>`` to P only after D's READ
finished, and P frees a lease's blocks only in the engine loop that also handles notifications. So if
the lease is still live when P handles the completion, no block was freed (or reused) during the read,
and P answers ``LK1:V:ok:<id>``; otherwise ``LK1:V:reaped:<id>``. D holds each protected read back until
every P agent it read from answered ``ok`` (or, fast path, while P's heartbeat acknowledgements already
prove every lease it read live past the moment D saw the read finish: no wait); ``reaped`` from any, or
no answer within ``timeout_s``
(P dead, partitioned, or its loop stalled longer than a lease), fails the read so that vLLM applies its
``kv_load_failure_policy`` (vllm 0.32.0 ``base_worker.py`` ``_invalid_block_ids``). No clocks are
compared across hosts: the only time D measures is its own wait.

Outcomes (a closed set, fit for a metric label): ``verified`` (every P agent said ok), ``reaped``
(P said the lease had ended: the read was discarded), ``timeout`` (no verdict in time: discarded),
``unprotected`` (P did not mark the request with ``leasekit_protocol``: a stock P; the read is used as
stock vLLM does, and only counted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

OUTCOME_VERIFIED = "verified"
OUTCOME_REAPED = "reaped"
OUTCOME_TIMEOUT = "timeout"
OUTCOME_UNPROTECTED = "unprotected"
READ_OUTCOMES = (OUTCOME_VERIFIED, OUTCOME_REAPED, OUTCOME_TIMEOUT, OUTCOME_UNPROTECTED)
"""Every outcome of :class:`ReadGate` (``leasekit_kv_lease_reads_total{outcome}``)."""

MAX_SENT_HEARTBEATS = 256
"""Heartbeat send instants remembered per P agent, awaiting that agent's acknowledgements."""

MAX_EARLY_VERDICTS = 65536
"""Verdicts kept for reads D has not seen finish yet (P can answer before D's next step polls the
transfer); the oldest are forgotten beyond this."""


def agent_name(agent: str | bytes) -> str:
    """A NIXL agent name as ``str`` (vLLM keeps the names ``add_remote_agent`` returned, which are
    ``bytes``; ``get_new_notifs`` keys are ``str``)."""
    return agent.decode("utf-8", "replace") if isinstance(agent, (bytes, bytearray)) else str(agent)


@dataclass
class GateResult:
    """One read the gate decided. ``request_id``: D's request id; ``remote_request_id``: P's;
    ``outcome``: one of :data:`READ_OUTCOMES`; ``wait_s``: seconds D held the read back (0 for
    ``unprotected``); ``agents``: the P agents it read from."""

    request_id: str
    remote_request_id: str
    outcome: str
    wait_s: float
    agents: tuple[str, ...] = ()


@dataclass
class _Read:
    remote_request_id: str = ""
    agents: set[str] = field(default_factory=set)
    held_since: float | None = None


class ReadGate:
    """Per-request state of D's protected reads.

    Args:
        timeout_s: seconds to wait for P's verdicts after the read finished (> 0); default of the
            connector: the lease duration ``L`` (P's loop handles notifications at least that often
            while it holds leases, or the lease would expire anyway).
        clock: seconds (``time.perf_counter``).

    Raises:
        ValueError: ``timeout_s`` is not > 0.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.perf_counter):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._reads: dict[str, _Read] = {}
        self._protected_at: dict[str, float] = {}
        self._verdicts: dict[tuple[str, str], bool] = {}  # (agent, P request id) -> ok; insertion-ordered
        self._sent: dict[str, dict[int, float]] = {}  # P agent -> {heartbeat seq: send instant}, unacked
        self._seq = 0
        self._horizon: dict[tuple[str, str], float] = {}  # (agent, P request id) -> held at least until
        self._decided: dict[tuple[str, str], None] = {}  # recently decided reads: late verdicts ignored

    def protect(self, request_id: str, now: float | None = None) -> None:
        """P marked ``request_id`` (D's id) with ``leasekit_protocol``: its read will wait for verdicts."""
        self._protected_at.setdefault(request_id, self._clock() if now is None else now)

    def is_protected(self, request_id: str) -> bool:
        """Whether ``request_id`` is protected (see :meth:`protect`)."""
        return request_id in self._protected_at

    def expect(self, request_id: str, agent: str, remote_request_id: str) -> None:
        """D posted a read of ``remote_request_id`` from P agent ``agent``: that agent must answer."""
        read = self._reads.setdefault(request_id, _Read())
        read.remote_request_id = remote_request_id
        read.agents.add(agent)

    def hold(self, request_id: str, now: float | None = None) -> bool:
        """The read of ``request_id`` finished on D. True: hold it back for verdicts (protected, with
        expected agents); False: use it now (not protected)."""
        read = self._reads.get(request_id)
        if request_id not in self._protected_at or read is None or not read.agents:
            return False
        if read.held_since is None:
            read.held_since = self._clock() if now is None else now
        return True

    def heartbeat_sent(self, agent: str, now: float | None = None) -> int:
        """D is about to send a heartbeat to P agent ``agent``; returns its sequence number (sent as the
        ``LK1~<n>`` token, echoed in P's acknowledgement). ``now``: when the send begins."""
        self._seq += 1
        sent = self._sent.setdefault(agent, {})
        sent[self._seq] = self._clock() if now is None else now
        while len(sent) > MAX_SENT_HEARTBEATS:
            del sent[next(iter(sent))]  # never acknowledged (lost): forgetting it loses nothing
        return self._seq

    def ack(self, agent: str, seq: int, remaining_s: float, remote_request_ids) -> None:
        """P acknowledged heartbeat ``seq`` of ``agent``: each lease was live with ``remaining_s`` to go.

        Matched by sequence number to the instant D began that send (no later than P read it), so the
        horizon ``send + remaining_s`` is never later than P's deadline. An ack for a send D does not
        know (forged, or forgotten) is ignored."""
        started = self._sent.get(agent, {}).pop(seq, None)
        if started is None:
            return
        horizon = started + float(remaining_s)
        for rid in remote_request_ids:
            key = (agent, rid)
            if horizon > self._horizon.get(key, float("-inf")):
                self._horizon[key] = horizon
        while len(self._horizon) > MAX_EARLY_VERDICTS:
            del self._horizon[next(iter(self._horizon))]

    def verdict(self, agent: str, remote_request_id: str, ok: bool) -> None:
        """P agent ``agent`` answered for ``remote_request_id``. A reaped answer is never overwritten."""
        key = (agent, remote_request_id)
        if key in self._decided:
            return  # decided already (fast path): P's verdict still comes, and is not kept
        self._verdicts[key] = self._verdicts.get(key, True) and ok
        while len(self._verdicts) > MAX_EARLY_VERDICTS:
            del self._verdicts[next(iter(self._verdicts))]

    def resolve(self, now: float | None = None) -> list[GateResult]:
        """Decide every held read that can be decided now (each is forgotten once decided)."""
        now = self._clock() if now is None else now
        decided = []
        for request_id, read in list(self._reads.items()):
            if read.held_since is None:
                continue
            answers = [self._verdicts.get((agent, read.remote_request_id)) for agent in read.agents]
            covered = all(self._horizon.get((agent, read.remote_request_id), float("-inf")) >= read.held_since
                          for agent in read.agents)
            if any(answer is False for answer in answers):
                outcome = OUTCOME_REAPED
            elif covered or all(answer is True for answer in answers):
                outcome = OUTCOME_VERIFIED
            elif now - read.held_since >= self.timeout_s:
                outcome = OUTCOME_TIMEOUT
            else:
                continue
            decided.append(GateResult(request_id, read.remote_request_id, outcome, max(0.0, now - read.held_since),
                                      tuple(sorted(read.agents))))
            self.forget(request_id)
        return decided

    def forget(self, request_id: str) -> None:
        """Drop everything about ``request_id`` (decided, aborted or failed by vLLM)."""
        read = self._reads.pop(request_id, None)
        self._protected_at.pop(request_id, None)
        if read is not None:
            for agent in read.agents:
                self._verdicts.pop((agent, read.remote_request_id), None)
                self._horizon.pop((agent, read.remote_request_id), None)
                self._decided[(agent, read.remote_request_id)] = None
            while len(self._decided) > MAX_SENT_HEARTBEATS * 16:
                del self._decided[next(iter(self._decided))]

    def sweep(self, live: set[str], now: float | None = None, max_age_s: float = 600.0) -> None:
        """Forget requests not in ``live`` (D's requests still receiving) that are not held, once older
        than ``max_age_s`` seconds (a protected request may wait a while for its handshake)."""
        now = self._clock() if now is None else now
        for request_id, since in list(self._protected_at.items()):
            read = self._reads.get(request_id)
            if request_id in live or (read is not None and read.held_since is not None):
                continue
            if now - since > max_age_s:
                self.forget(request_id)

    @property
    def held(self) -> int:
        """How many reads are held back waiting for verdicts."""
        return sum(1 for read in self._reads.values() if read.held_since is not None)
