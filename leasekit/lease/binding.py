"""Which NIXL agent may move a lease: bind each lease to the first D agent that heartbeats or reads it.

Stock vLLM 0.32.0 lets any peer that did the side-channel handshake extend any live lease (a
heartbeat naming its id) or release it (a forged ``"<id>:1"`` completion), so the real D may then
read freed blocks (``nixl/pull_worker.py: _get_new_notifs``, ``nixl/base_worker.py:
_handle_heartbeat``). :class:`LeaseBinding` is the rule LeaseKitConnector's P applies instead:

- the first agent whose heartbeat or completion names a live lease becomes its *bound* agent;
- heartbeats from any other agent are ``foreign`` (dropped, counted);
- a completion from the bound agent counts; from another agent it counts only when that agent
  claims a multi-consumer read (``n > 1``: heterogeneous TP, several D ranks each read a part) and
  fewer than :data:`MAX_CONSUMERS` agents were admitted; otherwise it is ``foreign``;
- a second completion from one agent is a ``duplicate`` (stock counts messages, so a repeat frees
  early);
- the lease is released only when ``n`` distinct agents completed, ``n`` taken from the bound agent's
  own completion, **and** the bound agent is one of them: no set of foreign agents can free it.

Limits (documented in docs/fail-closed.md): a peer that touches a lease before the real D does
becomes its bound agent (first contact wins); with D TP > 1 the sibling D workers' heartbeats are
counted as foreign (harmless: the bound worker's heartbeats extend the lease).

Pure: no clock, no I/O. Not thread-safe (P's engine loop is the only caller).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CONSUMERS = 64
"""Most distinct agents admitted as consumers of one lease (D TP ranks reading one P rank)."""

COUNTED, RELEASED, DUPLICATE, FOREIGN = "counted", "released", "duplicate", "foreign"
"""Outcomes of :meth:`LeaseBinding.completion`."""


@dataclass(slots=True)
class _Bound:
    agent: str
    expected: int | None = None  # n from the bound agent's completion
    consumers: tuple[str, ...] = ()  # agents whose completion counted (a few: one per D TP rank)


class LeaseBinding:
    """Per-lease sender binding (see module docstring). Keys are P-side request ids."""

    def __init__(self) -> None:
        self._bound: dict[str, _Bound | str] = {}  # a bare agent name until the first completion (smaller)

    def __len__(self) -> int:
        return len(self._bound)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._bound

    def bound_agent(self, req_id: str) -> str | None:
        """The agent ``req_id``'s lease is bound to, or None if no agent touched it yet."""
        bound = self._bound.get(req_id)
        return bound if bound is None or isinstance(bound, str) else bound.agent

    def heartbeat(self, req_id: str, agent: str) -> bool:
        """Whether ``agent``'s heartbeat may extend the live lease ``req_id`` (binds it on first contact)."""
        bound = self._bound.get(req_id)
        if bound is None:
            self._bound[req_id] = agent
            return True
        return (bound if isinstance(bound, str) else bound.agent) == agent

    def completion(self, req_id: str, agent: str, expected_consumers: int) -> str:
        """Apply one read completion ``"<req_id>:<expected_consumers>"`` from ``agent``.

        Returns:
            ``released`` (free the blocks now), ``counted`` (more consumers to come),
            ``duplicate`` or ``foreign`` (drop the message).

        Raises:
            ValueError: ``expected_consumers`` < 1 (the codec never yields one).
        """
        if expected_consumers < 1:
            raise ValueError(f"expected_consumers must be >= 1, got {expected_consumers}")
        bound = self._bound.get(req_id)
        if bound is None or isinstance(bound, str):
            bound = self._bound[req_id] = _Bound(agent if bound is None else bound)
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
