"""D, push mode: which WRITE notifications reach vLLM's accounting.

P announces each WRITE into D's blocks with one NIXL notification ``"{D request id}:{P TP size}"`` per writing
P rank, and vLLM's D counts them until it has one per producer rank, then reports the request's KV as received
(vllm 0.32.0 ``push_worker.py`` ``_get_new_notifs``). Stock D counts a notification from any NIXL agent and
counts a repeat again, so anything that reached D's NIXL agent could end a request's wait early and have D decode
KV blocks nobody wrote. LeaseKit's D hands vLLM only a notification whose sender is one of the agents of the P
engine the request registered with (the agents D sent its ``PUSH_REG`` to, vLLM's ``_remote_agents``), and only
the first from each of them per request. A NIXL agent name is the sender's claim, so this keeps out strangers
and repeats, not a peer that impersonates P's agent name.
"""

from __future__ import annotations

from typing import Collection, Container

FOREIGN_WRITE = "foreign_write"
"""Drop reason: a WRITE notification for a request D waits on, from an agent that is not one of its P's."""

DUPLICATE_WRITE = "duplicate_write"
"""Drop reason: a second WRITE notification from the same P agent for one request."""

DROP_REASONS = (FOREIGN_WRITE, DUPLICATE_WRITE)
"""The ``reason`` label values this guard adds to ``leasekit_kv_lease_notifications_dropped_total``."""


def agent_name(agent: object) -> str:
    """A NIXL agent name as text: NIXL hands notification senders as ``bytes`` and vLLM keeps the names it loaded
    as ``str`` (nixl 1.5.1), so both are compared in this one form."""
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode("utf-8", "surrogateescape")
    return str(agent)


class WriteNoteGuard:
    """Admits WRITE notifications on D (engine thread only: not thread-safe).

    Memory: one set of agent names per request D waits on; :meth:`prune` forgets requests D no longer waits on.
    """

    def __init__(self) -> None:
        self._heard: dict[str, set[str]] = {}

    def admit(self, req_id: str, agent: str | bytes, senders: Collection[str | bytes]) -> str | None:
        """None when D should count this WRITE notification for ``req_id`` from NIXL agent ``agent``; else the drop
        reason (:data:`FOREIGN_WRITE` when ``agent`` is not in ``senders``, the agent names of the request's P
        engine; :data:`DUPLICATE_WRITE` when ``agent`` was already counted for ``req_id``). Names are compared as
        text (:func:`agent_name`). Never raises."""
        agent = agent_name(agent)
        if agent not in {agent_name(a) for a in senders}:
            return FOREIGN_WRITE
        heard = self._heard.setdefault(req_id, set())
        if agent in heard:
            return DUPLICATE_WRITE
        heard.add(agent)
        return None

    def prune(self, waiting: Container[str]) -> None:
        """Forget the requests not in ``waiting`` (the request ids D still waits on, vLLM's ``_recving_metadata``)."""
        for req_id in [r for r in self._heard if r not in waiting]:
            del self._heard[req_id]

    def __len__(self) -> int:
        """How many requests have a counted notification remembered."""
        return len(self._heard)
