"""Span export off the engine thread: the SDK's BatchSpanProcessor, with every span accounted for.

The thread that ends a span (vLLM's engine thread) only appends it to a bounded queue; a background
thread of the OpenTelemetry SDK's ``BatchSpanProcessor`` drains the queue and encodes and writes
batches. When the queue is full the span is dropped and counted; ending a span never waits for an
exporter, however slow (full or frozen disk, an OTLP endpoint that never answers).

The SDK drops silently (its own drop metric is off unless ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED``
is set, and it evicts the oldest queued span). :class:`CountingBatchSpanProcessor` therefore admits a
span to the SDK's queue only while fewer than ``max_queue_size`` spans are admitted and not yet handed
to the exporter, which is never fewer than the SDK's queue holds, so the SDK's queue never overflows
and every drop is a drop counted here. A wrapping exporter counts the spans handed over and how each
export ended. Only the public SDK API is used: ``BatchSpanProcessor(exporter, max_queue_size,
schedule_delay_millis, max_export_batch_size, export_timeout_millis)``, ``on_end``, ``shutdown``,
``force_flush`` (opentelemetry-sdk ``sdk/trace/export/__init__.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSettings:
    """How one sink's spans are batched.

    Attributes:
        max_queue_size: spans waiting for export at most (>= 1); more are dropped and counted.
        schedule_delay_s: seconds between exports when fewer than ``max_export_batch_size`` wait (> 0).
        max_export_batch_size: spans per export call at most (1 .. ``max_queue_size``); a full batch
            is exported at once, without waiting for the delay.
        export_timeout_s: passed to the SDK as ``export_timeout_millis`` (> 0; SDK 1.45 does not use
            it: an exporter bounds its own calls, e.g. the OTLP exporter's ``OTEL_EXPORTER_OTLP_TIMEOUT``).
        shutdown_timeout_s: seconds :meth:`CountingBatchSpanProcessor.shutdown` waits for the queue to
            be exported (> 0); what is still queued then is dropped and counted.

    Raises:
        ValueError: a value out of its range; the message names the field and the range.
    """

    max_queue_size: int
    schedule_delay_s: float
    max_export_batch_size: int
    export_timeout_s: float
    shutdown_timeout_s: float

    def __post_init__(self) -> None:
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size={self.max_queue_size}: must be >= 1 span")
        if not 1 <= self.max_export_batch_size <= self.max_queue_size:
            raise ValueError(f"max_export_batch_size={self.max_export_batch_size}: must be in "
                             f"1 .. max_queue_size ({self.max_queue_size}) spans")
        for name in ("schedule_delay_s", "export_timeout_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")


@dataclass(frozen=True)
class SpanExportCounts:
    """Where the spans one sink was given are, in spans, since the processor started (or forked).

    ``ended == queued + exporting + exported + failed + dropped_queue_full + dropped_shutdown``.

    Attributes:
        sink: ``"file"`` or ``"otlp"``.
        ended: sampled spans that ended while the processor was attached.
        queued: admitted, waiting for the background thread.
        exporting: handed to the exporter in a call that has not returned yet.
        exported: in export calls that returned SUCCESS.
        failed: in export calls that returned FAILURE or raised (write error, OTLP timeout).
        dropped_queue_full: not queued: ``max_queue_size`` spans were already waiting.
        dropped_shutdown: ended after shutdown began, or still queued when shutdown stopped waiting.
    """

    sink: str
    ended: int
    queued: int
    exporting: int
    exported: int
    failed: int
    dropped_queue_full: int
    dropped_shutdown: int

    @property
    def dropped(self) -> int:
        """Spans never handed to the exporter (queue full, or shutdown)."""
        return self.dropped_queue_full + self.dropped_shutdown


def run_bounded(fn: Callable[[], object], timeout_s: float, name: str) -> tuple[bool, object]:
    """Run ``fn`` in a daemon thread and wait at most ``timeout_s`` seconds.

    Returns ``(finished, result)``; ``result`` is None when ``fn`` did not finish or raised (logged).
    Where no thread can be started (interpreter shutdown on Python >= 3.12), ``fn`` runs here."""
    box: list[object] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception:  # logged, not raised: a shutdown step must not stop the next one
            logger.exception("leasekit: %s failed", name)
            box.append(None)

    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        target()
        return True, box[0]
    thread.join(timeout_s)
    return (False, None) if thread.is_alive() else (True, box[0])


MAY_WAIT_ATTR = "leasekit_may_wait"
"""Set to True on a ``threading.Thread`` whose spans may wait for room in a full export queue (the lease
span builder's thread, :mod:`leasekit.telemetry.span_builder`); any other thread's span is dropped at once."""

MAY_WAIT_S = 1.0
"""Seconds such a thread waits for room before the span is dropped (an exporter that is stuck)."""


class CountingBatchSpanProcessor(SpanProcessor):
    """The SDK's ``BatchSpanProcessor`` in front of ``exporter``, counting every span it is given.

    ``on_end`` (the engine thread) takes a lock for a few integer updates and appends to the SDK's
    queue; it never encodes, writes, or waits for the exporter. Only a thread marked
    :data:`MAY_WAIT_ATTR` (the span builder's) waits, at most :data:`MAY_WAIT_S`, when the queue is full,
    so a burst of lease ends (a dead D's leases expiring together) is written, not dropped. Export runs on the SDK's background
    thread. Counts: :meth:`counts`.

    Args:
        exporter: the sink's exporter; its ``export`` may block or fail, only the background thread waits.
        sink: the sink's name in counts and log lines (``"file"``, ``"otlp"``).
        settings: queue, delay and timeout settings.
    """

    def __init__(self, exporter: SpanExporter, *, sink: str, settings: BatchSettings):
        self.sink = sink
        self.settings = settings
        self._lock = threading.Lock()
        self._reset_counts()
        self._exporter = _CountingExporter(exporter, self)
        self._batch = BatchSpanProcessor(
            self._exporter,
            max_queue_size=settings.max_queue_size,
            schedule_delay_millis=settings.schedule_delay_s * 1000.0,
            max_export_batch_size=settings.max_export_batch_size,
            export_timeout_millis=settings.export_timeout_s * 1000.0,
        )
        if hasattr(os, "register_at_fork"):  # the SDK empties its queue in a forked child; so do we
            weak_reset = weakref.WeakMethod(self._reset_counts)

            def reset_in_child() -> None:
                reset = weak_reset()
                if reset is not None:
                    reset()

            os.register_at_fork(after_in_child=reset_in_child)

    def _reset_counts(self) -> None:
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when the exporter takes spans from the queue
        self._ended = self._admitted = self._handed = self._exporting = 0
        self._exported = self._failed = self._dropped_full = self._dropped_shutdown = 0
        self._closing = self._finalized = False

    def on_start(self, span: Span, parent_context=None) -> None:
        """Nothing: spans are exported when they end."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue ``span`` for export, or count it dropped; never blocks on the exporter, never raises."""
        if not (span.context and span.context.trace_flags.sampled):
            return  # the SDK's BatchSpanProcessor exports sampled spans only
        with self._lock:
            self._ended += 1
            if self._closing:
                self._dropped_shutdown += 1
                return
            if self._admitted - self._handed >= self.settings.max_queue_size:
                if getattr(threading.current_thread(), MAY_WAIT_ATTR, False):  # a span-building thread, not
                    # the engine's: wait (bounded) for the exporter to take a batch rather than drop
                    self._room.wait_for(lambda: self._closing or
                                        self._admitted - self._handed < self.settings.max_queue_size, MAY_WAIT_S)
                if self._closing or self._admitted - self._handed >= self.settings.max_queue_size:
                    if self._closing:
                        self._dropped_shutdown += 1
                    else:
                        self._dropped_full += 1
                    return
            self._admitted += 1
        self._batch.on_end(span)

    def counts(self) -> SpanExportCounts:
        """A consistent snapshot of this sink's counts (cheap: one lock, no I/O)."""
        with self._lock:
            return SpanExportCounts(
                sink=self.sink, ended=self._ended, queued=self._admitted - self._handed,
                exporting=self._exporting, exported=self._exported, failed=self._failed,
                dropped_queue_full=self._dropped_full, dropped_shutdown=self._dropped_shutdown)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued; waits at most ``timeout_millis`` milliseconds (the SDK's own
        ``force_flush`` ignores its timeout). Returns False on timeout or after shutdown."""
        if self._closing:
            return False
        finished, result = run_bounded(self._batch.force_flush, timeout_millis / 1000.0,
                                       f"leasekit-{self.sink}-span-flush")
        return bool(finished and result)

    def shutdown(self) -> None:
        """Export what is queued, waiting at most ``settings.shutdown_timeout_s`` seconds, then shut the
        exporter down. Spans still queued then, and spans ended later, are counted in
        ``dropped_shutdown``. Idempotent; never raises."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._room.notify_all()
        finished, _ = run_bounded(self._batch.shutdown, self.settings.shutdown_timeout_s,
                                  f"leasekit-{self.sink}-span-shutdown")
        with self._lock:
            self._finalized = True
            left = self._admitted - self._handed
            self._dropped_shutdown += left
            self._admitted = self._handed
        if not finished or left:
            logger.warning("leasekit: %s span export did not finish within %.1f s at shutdown; %d queued "
                           "span(s) dropped", self.sink, self.settings.shutdown_timeout_s, left)


class _CountingExporter(SpanExporter):
    """Counts spans handed to ``inner`` and how each export ended, into ``owner``'s counts."""

    def __init__(self, inner: SpanExporter, owner: CountingBatchSpanProcessor):
        self.inner, self._owner = inner, owner
        self._shut = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        owner, n = self._owner, len(spans)
        with owner._lock:
            if owner._finalized:  # popped after shutdown gave up: already counted as dropped
                return SpanExportResult.FAILURE
            owner._handed += n
            owner._exporting += n
            owner._room.notify_all()
        ok = False
        try:
            ok = self.inner.export(spans) is SpanExportResult.SUCCESS
        except Exception:
            logger.exception("leasekit: %s span exporter raised", owner.sink)
        finally:
            with owner._lock:
                owner._exporting -= n
                if ok:
                    owner._exported += n
                else:
                    owner._failed += n
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        """Shut ``inner`` down once."""
        if not self._shut:
            self._shut = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Delegate to ``inner``."""
        return self.inner.force_flush(timeout_millis)
