"""Build spans off P's engine thread: ended leases go into a bounded queue that one daemon thread drains.

Building an OpenTelemetry span costs tens of microseconds in the SDK (attribute validation, one object
per event, ids from the OS's random source). :class:`SpanBuilder` moves that work, and everything the
span processors do after it, off the thread that calls the recorder: the caller pays one queue append.
The queue is bounded; when it is full the span is dropped and counted (:attr:`SpanBuilder.dropped`),
never waited for. ``background=False`` builds inline (tests, tools).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from leasekit.telemetry.batching import MAY_WAIT_ATTR

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 65536
"""Ended leases waiting for their span at most (each holds its compact lease record, a few hundred bytes)."""


class SpanBuilder:
    """Runs span-building callables inline or on one daemon thread.

    Args:
        background: True: a daemon thread runs the callables in submission order; False: inline.
        max_pending: queued callables at most (>= 1); beyond it :meth:`submit` drops and counts.
        name: the thread's name.

    Raises:
        ValueError: ``max_pending`` < 1.
    """

    def __init__(self, *, background: bool = True, max_pending: int = DEFAULT_MAX_PENDING,
                 name: str = "leasekit-spans"):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.background = background
        self.dropped = 0
        self.failed = 0
        self._max = max_pending
        self._queue: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._running = False  # the thread is inside a callable it popped
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            setattr(self._thread, MAY_WAIT_ATTR, True)  # its spans wait for room in a full export queue
            self._thread.start()

    def submit(self, build: Callable[[], None]) -> bool:
        """Build one span (``build()``): now, or queued for the thread. False if it was dropped (queue
        full, or closed). Never raises for a failing ``build`` (counted in :attr:`failed`)."""
        if not self.background:
            self._call(build)
            return True
        if self._closed or len(self._queue) >= self._max:
            self.dropped += 1
            return False
        self._queue.append(build)
        with self._wake:
            self._wake.notify()
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait up to ``timeout_s`` seconds until every queued span is built; True if the queue is empty."""
        if not self.background:
            return True
        deadline = time.monotonic() + timeout_s
        while self._queue or self._running:
            if time.monotonic() >= deadline or self._thread is None or not self._thread.is_alive():
                return not self._queue and not self._running
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Build what is queued (up to ``timeout_s`` seconds), then stop the thread; later submits are
        dropped. True if nothing was left behind (the rest is counted in :attr:`dropped`)."""
        done = self.flush(timeout_s)
        self._closed = True
        with self._wake:
            self._wake.notify()
        if not done:
            self.dropped += len(self._queue)
            self._queue.clear()
        return done

    def _call(self, build: Callable[[], None]) -> None:
        try:
            build()
        except Exception as exc:  # a span we could not build must not stop the others
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                logger.warning("leasekit: could not build a lease span (%d so far): %s: %s", self.failed,
                               type(exc).__name__, exc)

    def _run(self) -> None:
        queue = self._queue
        while True:
            with self._wake:
                while not queue and not self._closed:
                    self._wake.wait(1.0)
            if not queue and self._closed:
                return
            while queue:
                self._running = True  # before the pop: flush() never sees an empty queue and no work
                try:
                    build = queue.popleft()
                except IndexError:
                    self._running = False
                    break
                self._call(build)
                self._running = False
