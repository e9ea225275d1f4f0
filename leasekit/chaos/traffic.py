"""Background prefill-only traffic on P during a fault run (P stays busy, as in production)."""

from __future__ import annotations

import threading

from leasekit.cluster.pair import PDPair


class PrefillTraffic:
    """Prefill-only requests on P at ``rps`` per second in a background thread (P stays busy)."""

    def __init__(self, pair: PDPair, rps: float):
        self.pair, self.rps = pair, rps
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def start(self) -> None:
        """Start sending (no-op when ``rps`` is 0)."""
        if self.rps <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="prefill-traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0 / self.rps):
            if self.pair.router is not None:
                self.pair.router.prefill(self.pair.prompt(32))
                self.sent += 1

    def stop(self) -> None:
        """Stop sending and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
