"""What one P worker remembers of the D agents it hears from, so an expiry can say whether its D was alive.

Metrics never name a D worker (an agent name is a claim any peer can make, and a new one appears at every D
restart: :mod:`leasekit.lease.peerref`), so the question "did this lease expire while its D still
heartbeated?" is answered here, in the worker, where the agent name may be used, and exported as a closed
label set (``peer_state`` on ``leasekit_kv_lease_expiries_total``) and a counter of returns
(``leasekit_kv_lease_expired_peer_returns_total``).

- :class:`Peer`: one D agent: its :func:`~leasekit.lease.peerref.peer_ref` (what spans, logs and events
  carry), when P last took a heartbeat from it, and the expiries of its leases it has not yet come back
  from.
- :class:`PeerTable`: agent name -> :class:`Peer`, bounded (:data:`MAX_PEERS`; peers without an open lease
  and without a pending return are dropped first).

State rules (seconds, on the worker clock the recorder uses):

- ``heartbeating``: the lease's agent delivered a heartbeat (for any lease of this worker) less than
  ``2 * H`` before the reap: D is alive and stopped heartbeating this request (a client abort on D, a lost
  heartbeat) or the lease hit its max hold. ``2 * H``: one lost heartbeat is within D's loss budget; a dead D
  was last heard at least ``E = 4 * H`` before its leases' reap (the deadline is its last heartbeat + E).
- ``silent``: heard from before, not in the last ``2 * H``: D died, stalled or was cut off. A stall is told
  from a death later: if the same agent is heard from again (a lease of it is bound: its first heartbeat
  or read) within :data:`RETURN_WINDOW_S` of the expiry, its silent expiries are reported as returned. A
  restarted D is a new agent and never returns.
- ``unknown``: P never heard from any D about the lease (no heartbeat, no read).

Pure: no clock, no I/O; not thread-safe (the recorder's caller's thread only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from leasekit.lease.peerref import peer_ref
from leasekit.telemetry import lease_events as ev

SILENT_AFTER_INTERVALS = 2
"""A D agent not heard from for this many heartbeat intervals ``H`` is ``silent`` (see the module doc)."""
RETURN_WINDOW_S = 600.0
"""Seconds after a silent expiry within which hearing from the same agent counts it as returned (the
10-minute window of the LeaseExpiriesWhileDecodeHealthy alert)."""
MAX_PEERS = 1024
"""Agents a :class:`PeerTable` keeps before pruning those with no open lease and no pending return."""


@dataclass(slots=True, eq=False)
class Peer:
    """One D agent as one P worker knows it.

    Attributes:
        ref: :func:`~leasekit.lease.peerref.peer_ref` of its agent name (never the name itself).
        last_s: when P last took a heartbeat from it (seconds, worker clock; None: never).
        lapsed: leases of it that expired while it was silent and that it has not come back from.
        lapsed_s: when the latest of those expired (seconds, worker clock).
    """

    ref: str
    last_s: float | None = None
    lapsed: int = 0
    lapsed_s: float = 0.0

    def state(self, now: float, heartbeat_interval_s: float) -> str:
        """``heartbeating`` or ``silent`` at ``now`` (seconds) for heartbeat interval ``H`` (seconds)."""
        if self.last_s is not None and now - self.last_s < SILENT_AFTER_INTERVALS * heartbeat_interval_s:
            return ev.PEER_HEARTBEATING
        return ev.PEER_SILENT

    def lapse(self, now: float) -> None:
        """Count one silent expiry of its leases at ``now`` (seconds)."""
        self.lapsed += 1
        self.lapsed_s = now

    def come_back(self, now: float) -> int:
        """It was heard from at ``now``: the silent expiries it returned from within
        :data:`RETURN_WINDOW_S` (0 if none, or if they are older), which are then forgotten."""
        count, self.lapsed = self.lapsed, 0
        return count if count and now - self.lapsed_s <= RETURN_WINDOW_S else 0


class PeerTable:
    """Agent name -> :class:`Peer` for one P worker, at most about :data:`MAX_PEERS` entries.

    :attr:`known` is the mapping itself (read-only to callers: a caller on a hot path may look a known peer
    up there without a call, and must use :meth:`get` for a miss).

    Args:
        max_peers: the size above which :meth:`get` prunes (>= 1).

    Raises:
        ValueError: ``max_peers`` < 1.
    """

    def __init__(self, max_peers: int = MAX_PEERS):
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        self.known: dict[object, Peer] = {}
        self._max = max_peers

    def __len__(self) -> int:
        return len(self.known)

    def get(self, agent: object, now: float, in_use: Iterable[Peer | None] = ()) -> Peer:
        """The :class:`Peer` of ``agent`` (a NIXL agent name, any hashable), created if new. Creating one
        past the size limit first drops every peer that is neither in ``in_use`` (the peers of open
        leases; iterated only then) nor owed a return within :data:`RETURN_WINDOW_S` of ``now``."""
        known = self.known
        peer = known.get(agent)
        if peer is not None:
            return peer
        if len(known) >= self._max:  # pruned in place: ``known`` stays the same object
            keep = {id(p) for p in in_use if p is not None}
            for a in [a for a, p in known.items()
                      if id(p) not in keep and not (p.lapsed and now - p.lapsed_s <= RETURN_WINDOW_S)]:
                del known[a]
        peer = known[agent] = Peer(peer_ref(agent))
        return peer
