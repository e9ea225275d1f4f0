"""Which D may move a lease: a proof of the lease's secret where D gives one, else the first D agent that
heartbeats or reads it.

Stock vLLM 0.32.0 lets any peer that did the side-channel handshake extend any live lease (a
heartbeat naming its id) or release it (a forged ``"<id>:1"`` completion), so the real D may then
read freed blocks (``nixl/pull_worker.py: _get_new_notifs``, ``nixl/base_worker.py:
_handle_heartbeat``). :class:`LeaseBinding` is the rule LeaseKitConnector's P applies instead. A lease is
bound one of two ways:

- **proven** (:meth:`LeaseBinding.prove`): a message carried the lease's heartbeat or completion tag
  (:mod:`leasekit.lease.proof`). From then on only tagged messages move it: a plain one, or one with a
  wrong tag, is ``unproven`` whatever agent name it claims. The binding keeps the heartbeat tag, so a
  later heartbeat costs one comparison;
- **plain** (a stock D): the first agent whose plain heartbeat or completion names the lease becomes its
  bound agent; heartbeats from any other agent are ``foreign``. A later proof takes the lease over (the
  plain consumers counted so far are forgotten): an agent name is only a claim.

Completions, either way: a completion from the bound agent (or, proven, any tagged one: every D TP rank that
reads the lease holds its secret) counts; from another plain agent it counts only when that agent claims a
multi-consumer read (``n > 1``: heterogeneous TP, several D ranks each read a part) and fewer than
:data:`MAX_CONSUMERS` agents were admitted; otherwise it is ``foreign``; a second completion from one agent
is a ``duplicate`` (stock counts messages, so a repeat frees early); the lease is released only when ``n``
distinct agents completed, ``n`` taken from the bound agent's own (or a proven) completion, **and** (plain)
the bound agent is one of them: no set of foreign agents can free it.

Limits (documented in docs/security.md): a plain lease's first contact wins (the claim window of
:mod:`leasekit.lease.pkeeping` keeps a plain first contact from moving a lease its D may still prove); with
D TP > 1 the sibling D workers' plain heartbeats are counted as foreign (harmless: the bound worker's
heartbeats extend the lease).

Pure: no clock, no I/O. Not thread-safe (P's engine loop is the only caller).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

MAX_CONSUMERS = 64
"""Most distinct agents admitted as consumers of one lease (D TP ranks reading one P rank)."""

COUNTED, RELEASED, DUPLICATE, FOREIGN = "counted", "released", "duplicate", "foreign"
"""Outcomes of :meth:`LeaseBinding.completion`."""
UNPROVEN = "unproven"
"""A plain message for a proven lease (or, from :mod:`leasekit.lease.pkeeping`, a tag that does not verify)."""
NEEDS_PROOF = "needs_proof"
"""A tagged heartbeat for a lease not proven yet: the caller checks the tag and calls :meth:`LeaseBinding.prove`."""


@dataclass(slots=True)
class _Bound:
    agent: str | bytes  # the bound agent's name (plain) or the lease's heartbeat tag, 8 raw bytes (proven)
    expected: int | None = None  # n from the bound agent's (or a proven) completion
    consumers: tuple[str, ...] = ()  # agents whose completion counted (a few: one per D TP rank)


class LeaseBinding:
    """Per-lease binding (see module docstring). Keys are P-side request ids. A value is the bound agent's
    name (``str``, plain), the lease's heartbeat tag (``bytes``, proven), or completion state."""

    def __init__(self) -> None:
        self._bound: dict[str, _Bound | str | bytes] = {}  # a bare name or tag until the first completion

    def __len__(self) -> int:
        return len(self._bound)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._bound

    def bound_agent(self, req_id: str) -> str | None:
        """The agent ``req_id``'s plain lease is bound to, or None (untouched, or proven)."""
        bound = self._bound.get(req_id)
        agent = bound.agent if isinstance(bound, _Bound) else bound
        return agent if isinstance(agent, str) else None

    def proven(self, req_id: str) -> bool:
        """Whether ``req_id``'s lease is bound by a proof."""
        bound = self._bound.get(req_id)
        return isinstance(bound.agent if isinstance(bound, _Bound) else bound, bytes)

    def prove(self, req_id: str, heartbeat_tag: bytes) -> bool:
        """Bind ``req_id`` by proof (``heartbeat_tag``: its tag, 8 raw bytes, checked by the caller). A plain
        binding is taken over and its plain consumers forgotten; a proven lease keeps its completion state.
        Returns True when the lease was not proven before."""
        bound = self._bound.get(req_id)
        if isinstance(bound, _Bound):
            if isinstance(bound.agent, bytes):
                return False
            self._bound[req_id] = heartbeat_tag
            return True
        if isinstance(bound, bytes):
            return False
        self._bound[req_id] = heartbeat_tag
        return True

    def heartbeat(self, req_id: str, agent: str, tag: bytes | None = None) -> bool | str:
        """Whether a heartbeat from ``agent`` naming ``req_id`` (with ``tag``, 8 raw bytes, or plain) may extend
        the live lease: True; :data:`UNPROVEN` (plain or wrong tag on a proven lease); :data:`NEEDS_PROOF`
        (tagged, lease not proven: check the tag, then :meth:`prove`); False (plain, bound to another agent).
        A plain heartbeat binds an untouched lease to ``agent``."""
        bound = self._bound.get(req_id)
        if bound is None:
            if tag is not None:
                return NEEDS_PROOF
            self._bound[req_id] = agent
            return True
        held = bound.agent if isinstance(bound, _Bound) else bound
        if isinstance(held, bytes):
            return True if tag is not None and hmac.compare_digest(held, tag) else UNPROVEN
        if tag is not None:
            return NEEDS_PROOF
        return held == agent

    def completion(self, req_id: str, agent: str, expected_consumers: int, *, proven: bool = False) -> str:
        """Apply one read completion ``"<req_id>:<expected_consumers>"`` from ``agent``; ``proven``: it carried
        a verified completion tag (the caller checked it and proved the lease first).

        Returns:
            ``released`` (free the blocks now), ``counted`` (more consumers to come),
            ``duplicate``, ``foreign`` or ``unproven`` (drop the message).

        Raises:
            ValueError: ``expected_consumers`` < 1 (the codec never yields one).
        """
        if expected_consumers < 1:
            raise ValueError(f"expected_consumers must be >= 1, got {expected_consumers}")
        bound = self._bound.get(req_id)
        if not isinstance(bound, _Bound):
            if isinstance(bound, bytes) and not proven:
                return UNPROVEN
            bound = self._bound[req_id] = _Bound(agent if bound is None else bound)
        if isinstance(bound.agent, bytes):
            if not proven:
                return UNPROVEN
            if agent in bound.consumers:
                return DUPLICATE
            bound.expected = expected_consumers
            bound.consumers += (agent,)
            if len(bound.consumers) >= expected_consumers:
                del self._bound[req_id]
                return RELEASED
            return COUNTED
        if agent in bound.consumers:
            return DUPLICATE
        if agent == bound.agent:
            bound.expected = expected_consumers
        elif expected_consumers <= 1 or len(bound.consumers) >= MAX_CONSUMERS:
            return FOREIGN
        bound.consumers += (agent,)
        if bound.expected is not None and bound.agent in bound.consumers and len(bound.consumers) >= bound.expected:
            del self._bound[req_id]
            return RELEASED
        return COUNTED

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s binding (its lease ended); idempotent."""
        self._bound.pop(req_id, None)

    def retain(self, live: "set[str] | dict[str, object]") -> int:
        """Drop bindings of leases not in ``live``; returns how many were dropped."""
        stale = [req_id for req_id in self._bound if req_id not in live]
        for req_id in stale:
            del self._bound[req_id]
        return len(stale)
