"""Blocked span sinks: LeaseKit's P worker with its span export stuck, against the same worker with a
normal span file, interleaved; the goal is that P's steps do not notice.

- A frozen span file (:func:`frozen_span_dir`): the span file's path is a symbolic link to a FIFO that
  this process holds open for reading and never reads. Once the pipe's buffer (64 KiB on Linux) is
  full, every write blocks, as on a frozen filesystem (a hung NFS mount, a cgroup-frozen disk writer).
- An OTLP endpoint that never answers (:func:`otlp_black_hole`, :func:`otlp_env`): a real TCP
  server on 127.0.0.1 that accepts connections and never reads or answers; the worker exports to it by
  OTLP (``http/protobuf``) besides its normal span file. Each export waits for an answer until the
  exporter's own timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``) and fails.

Nothing in LeaseKit is changed or patched: the production provider, batch processors and exporters
meet a real blocking ``write(2)`` or a real hanging HTTP request. The exporter's thread blocks; its
queue fills (2048 spans) and later spans are dropped and counted.
"""

from __future__ import annotations

import os
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from benchmarks.pstep import build as B

OTLP_PROTOCOL = "http/protobuf"  # OpenTelemetry's default OTLP protocol, and LeaseKit's
OTLP_TIMEOUT_S = 10.0  # OTEL_EXPORTER_OTLP_TIMEOUT's default (OpenTelemetry spec, "OTLP Exporter Configuration")
OTLP_SET_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TIMEOUT")
OTLP_CLEARED_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                    "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                    "OTEL_BSP_EXPORT_TIMEOUT")
"""Variables that would override the three set (the ``TRACES_`` forms win, OpenTelemetry spec) or change
the OTLP sink's batching from its defaults; unset while the OTLP side is built, so a user's
environment does not change the benchmark (as :func:`benchmarks.pstep.build.telemetry_env` does for
the endpoints)."""
BLACK_HOLE_THREAD = "leasekit-bench-otlp-black-hole"
ACCEPT_POLL_S = 0.05  # how often the accepting thread looks whether it should stop


@contextmanager
def frozen_span_dir(run_dir: Path, tp_rank: int = 0) -> Iterator[Path]:
    """Prepare ``run_dir`` so that the span file of this process's P worker (``kv_producer``,
    ``build.P_ENGINE``, ``tp_rank``) is a FIFO held open and never read. Yields the FIFO's path; on exit
    the read end is closed (a blocked writer then gets EPIPE and goes on).

    Raises:
        OSError: ``run_dir/spans/frozen.fifo`` or the span file's link already exists."""
    spans = run_dir / "spans"
    spans.mkdir(parents=True, exist_ok=True)
    fifo = spans / "frozen.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader exists, so the writer's open succeeds
    (spans / f"kv_producer-{B.P_ENGINE}-tp{tp_rank}-{os.getpid()}.jsonl").symlink_to(fifo)
    try:
        yield fifo
    finally:
        os.close(reader)


@contextmanager
def otlp_black_hole(host: str = "127.0.0.1") -> Iterator[str]:
    """A TCP server on ``host`` (an ephemeral port) that accepts every connection and never reads from
    it nor answers: the kernel completes the handshake and buffers what the client sends until the
    socket's receive buffer is full, then the client's sends block too. Accepting runs on a daemon
    thread named :data:`BLACK_HOLE_THREAD`; the accepted sockets are kept open.

    Yields the OTLP endpoint URL, ``http://<host>:<port>`` (the exporter appends ``/v1/traces``). On
    exit the thread is stopped and joined (within about :data:`ACCEPT_POLL_S` seconds), and the
    listening socket and every accepted socket are closed: a client still waiting then sees the
    connection reset or closed.

    Raises:
        OSError: no port could be bound on ``host``."""
    listener = socket.create_server((host, 0))
    listener.settimeout(ACCEPT_POLL_S)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:  # the listener was closed
                return
            accepted.append(conn)  # never recv(), never send(): a peer that never answers

    thread = threading.Thread(target=accept, name=BLACK_HOLE_THREAD, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10 * ACCEPT_POLL_S + 1.0)
        listener.close()
        for conn in accepted:
            conn.close()


def otlp_env(url: str, timeout_s: float = OTLP_TIMEOUT_S) -> dict[str, str | None]:
    """The environment a LeaseKit worker is built with (``extra_env`` of
    :func:`benchmarks.pstep.build.make_leasekit_worker`) so that it also exports its spans by OTLP to
    ``url`` besides its span file: ``OTEL_EXPORTER_OTLP_ENDPOINT`` = ``url``,
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` = ``http/protobuf``, ``OTEL_EXPORTER_OTLP_TIMEOUT`` = ``timeout_s``
    (seconds each export waits for an answer, retries included), and :data:`OTLP_CLEARED_ENV` unset.
    LeaseKit's provider reads them when ``_lk_setup`` builds it; the environment is restored right after.

    Raises:
        ValueError: ``timeout_s`` is not > 0 seconds."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: the OTLP timeout must be > 0 seconds")
    return {**dict.fromkeys(OTLP_CLEARED_ENV), **dict(zip(OTLP_SET_ENV, (url, OTLP_PROTOCOL, f"{timeout_s:g}")))}


def settle(worker: Any, timeout_s: float = 10.0) -> bool:
    """Wait up to ``timeout_s`` seconds until the worker's span builder has built every ended lease's
    span and handed it to the span processors (spans are built off the engine step, so counts read
    right after the timed steps may miss the last ones). True if nothing is left to build; never raises."""
    return worker._lk_spans.flush(timeout_s)


def unexported(worker: Any) -> dict[str, int]:
    """Spans the worker dropped (queue full, shutdown, or never built: the span builder's own queue)
    and failed to export (in export calls that failed or timed out), summed over its sinks, as its
    ``leasekit_spans_dropped_total`` reports them: ``{"dropped": int, "failed": int}``."""
    return {"dropped": worker._lk_provider.dropped_spans() + worker._lk_spans.dropped,
            "failed": worker._lk_provider.failed_spans() + worker._lk_spans.failed}


def sink_counts(worker: Any) -> dict[str, dict[str, int]]:
    """Per sink (``"file"``, ``"otlp"``), where the spans it was given are: ``ended``, ``queued``,
    ``exporting`` (in an export call that has not returned: stuck on the black hole), ``exported``,
    ``failed``, ``dropped_queue_full``, ``dropped_shutdown`` (spans; LeaseKit's ``SpanExportCounts``)."""
    return {sink: {name: value for name, value in vars(counts).items() if name != "sink"}
            for sink, counts in worker._lk_provider.span_export_counts().items()}
