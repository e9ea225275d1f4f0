"""Pairs of the next test module started ahead, in the background, as the chaos suite starts its
next pairs: engines take ~45 s to start here, and an integration module's second pair can warm up
while its first test runs.

A module lists the pairs its tests start in ``PREFETCH_PAIRS`` (:class:`PairSpec` objects, in the
order the tests use them). When the last test of the module before it starts (or the module's own
first test, if none ran before it), they are launched idle (``SCHED_BATCH``, nice 10; held with SIGSTOP
while a server a test waits for starts, parked once healthy: :mod:`leasekit.cluster.background`).
A test takes one with :meth:`PairPrefetch.pair_for` and starts it with ``PDPair.start()`` (which
promotes it); a spec nobody prefetched gets a new, unstarted pair. Unclaimed pairs are stopped at
the end of the session. A failed head start only costs time: the test starts its own pair."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from leasekit.cluster.pair import PairSpec, PDPair


class PairPrefetch:
    """Pairs launched idle ahead of the tests that will use them, keyed by their spec."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[PDPair]] = {}

    def prefetch(self, specs: list[PairSpec], make_dir: Callable[[], Path]) -> None:
        """Launch, idle, one pair per spec in ``specs`` not already waiting (``make_dir()`` gives
        each its run directory). Errors are swallowed: a head start is an optimisation."""
        for spec in specs:
            if self.waiting.get(repr(spec)):
                continue
            try:
                self.waiting.setdefault(repr(spec), []).append(PDPair(spec, make_dir()).launch(idle=True))
            except Exception:  # noqa: BLE001 - the test then starts its own pair
                pass

    def pair_for(self, spec: PairSpec, run_dir: Path) -> PDPair:
        """A pair for ``spec``, not yet started: the prefetched one (its servers still alive) or a
        new one under ``run_dir``. Start it with ``start()`` (or ``with pair:``)."""
        for pair in self.waiting.pop(repr(spec), []):
            if pair.prefill.alive() and pair.decode.alive():
                return pair
            pair.stop(grace_s=1)
        return PDPair(spec, run_dir)

    def stop(self) -> None:
        """Stop every pair nobody claimed (idempotent)."""
        while self.waiting:
            for pair in self.waiting.popitem()[1]:
                pair.stop(grace_s=2)


PREFETCH = PairPrefetch()
"""The session's prefetched pairs (filled by tests/conftest.py, claimed by the tests)."""
