"""Servers warming up in the background (spare Ds and the next pairs of a chaos suite) give way to
the servers that a run waits for.

A spare starts as background work (``SCHED_BATCH``, nice 10), but on a small machine that is not
enough: vLLM's engines busy-poll (a running P spins on its NIXL progress while it holds leases), so a
D restarting in the foreground next to six warming spares got a fraction of a core and took 2-3
minutes instead of one. Two rules, for every local server started idle
(:meth:`leasekit.cluster.server.VllmServer.start` with ``idle=True``) until it is promoted:

- :func:`paused_for_foreground`: while a foreground server starts (``wait_healthy``), every
  background server still warming up is held with SIGSTOP and resumed afterwards;
- a daemon thread parks (SIGSTOP) a background server as soon as it answers ``/health``, so a
  ready spare does not spin beside the running scenario until it is promoted.

Both only send SIGSTOP/SIGCONT to the server's own process group; :meth:`VllmServer.promote`,
``stop`` and ``begin_stop`` resume it first. Thread-safe (one lock for every state change).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from typing import Iterator

from leasekit.cluster import procs

PARK_POLL_S = 1.0
"""How often (seconds) the parking thread looks for background servers that became healthy."""

LOCK = threading.RLock()
"""Held for every change of a background server's ``idle``/``parked``/``paused`` state."""

_SERVERS: "weakref.WeakSet" = weakref.WeakSet()
_parker: threading.Thread | None = None


def register(server) -> None:
    """Track ``server`` (started with ``idle=True``) until :func:`unregister`; starts the parking
    thread on first use."""
    global _parker
    with LOCK:
        _SERVERS.add(server)
        if _parker is None or not _parker.is_alive():
            _parker = threading.Thread(target=_park_loop, name="leasekit-park-spares", daemon=True)
            _parker.start()


def unregister(server) -> None:
    """Stop tracking ``server`` (promoted or stopped); no-op if not tracked."""
    with LOCK:
        _SERVERS.discard(server)


def _warming(server) -> bool:
    """Started idle, running, neither parked nor paused (a candidate to pause or to park)."""
    return server.idle and not server.parked and not server.paused and server.proc is not None and server.alive()


@contextlib.contextmanager
def paused_for_foreground() -> Iterator[list]:
    """Hold every background server still warming up (SIGSTOP of its process group) for the
    duration of the block, then resume those this block held (SIGCONT). Yields the held servers.
    Nested or concurrent blocks hold each server once; a server promoted or stopped meanwhile was
    already resumed by that call."""
    with LOCK:
        held = [server for server in list(_SERVERS) if _warming(server)]
        for server in held:
            server.paused = procs.signal_group(server.proc.pid, signal.SIGSTOP)
    try:
        yield held
    finally:
        with LOCK:
            for server in held:
                if server.paused and server.proc is not None:
                    procs.signal_group(server.proc.pid, signal.SIGCONT)
                server.paused = False


def park_ready() -> list:
    """One pass: park every background server that is warming and answers ``/health`` (1 s
    timeout; :meth:`leasekit.cluster.server.VllmServer.park`); returns the servers parked."""
    return [server for server in list(_SERVERS) if _warming(server) and server.park()]


def _park_loop() -> None:
    while True:
        try:
            park_ready()
        except Exception:  # noqa: BLE001 - parking is an optimisation; a failed pass is retried
            pass
        threading.Event().wait(PARK_POLL_S)
