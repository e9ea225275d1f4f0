"""One real LeaseKit P/D pair shared by the integration modules that need the same pair.

``tests/integration/test_handshake_listener.py`` and ``tests/integration/test_hostile_peer.py`` both
need a LeaseKitConnector P and D with L = 6 s; the hostile-peer tests also need P's max hold at
12 s, which no listener test comes near (their leases last well under a second). Starting the pair
once instead of once per module saves one pair start (about 75 s on 2 cores).

The ``shared_pair`` fixture (``tests/conftest.py``) starts it on first use and stops it as soon as the
next test does not use it, so it never runs beside another module's pair; a module run alone starts
it too. Tests on it compare counters as before/after deltas, since the other module may have run first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

L = 6
"""Lease duration of the shared pair, seconds."""
MAX_HOLD = 12
"""LeaseKit P's max hold (``leasekit_max_hold_s``) on the shared pair, seconds."""


class SharedPair:
    """Holds the shared pair between tests: started lazily, restarted when a previous user left it
    unhealthy (so one module's broken pair does not fail the next module's tests), stopped on demand."""

    def __init__(self) -> None:
        self.pair = None
        self.starts = 0

    def get(self, run_dir: Callable[[], Path]):
        """The running pair (a :class:`leasekit.cluster.pair.PDPair`), started in ``run_dir()`` if none is,
        or if P or D no longer answers ``/health``.

        Raises:
            ServerStartError / WarmUpError: the pair did not start (nothing is left running).
        """
        from leasekit.cluster.pair import PairSpec, PDPair

        if self.pair is not None and not (self.pair.prefill.healthy() and self.pair.decode.healthy()):
            self.stop()
        if self.pair is None:
            pair = PDPair(PairSpec.pinned(lease_duration_s=L, prefill_max_hold_s=MAX_HOLD), run_dir())
            self.pair, self.starts = pair.start(), self.starts + 1  # start() stops both servers if it fails
        return self.pair

    def stop(self) -> None:
        """Stop the pair if one is running (idempotent)."""
        pair, self.pair = self.pair, None
        if pair is not None:
            pair.stop()
