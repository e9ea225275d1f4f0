"""A frozen span sink: LeaseKit's P worker with its span file on a pipe nobody reads, against the same
worker with a normal span file, interleaved; the goal is that P's steps do not notice.

The span file's path is a symbolic link to a FIFO that this process holds open for reading and never
reads: once the pipe's buffer (64 KiB on Linux) is full, every write blocks, as on a frozen filesystem
(a hung NFS mount, a cgroup-frozen disk writer). Nothing in LeaseKit is changed or patched: the
production provider, batch processor and exporter meet a real blocking ``write(2)``. The exporter's
thread blocks; the batch queue fills (2048 spans) and later spans are dropped and counted.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from benchmarks.pstep import build as B


@contextmanager
def frozen_span_dir(run_dir: Path, tp_rank: int = 0) -> Iterator[Path]:
    """Prepare ``run_dir`` so that the span file of this process's P worker (``kv_producer``,
    ``build.P_ENGINE``, ``tp_rank``) is a FIFO held open and never read. Yields the FIFO's path; on exit
    the read end is closed (a blocked writer then gets EPIPE and goes on)."""
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


def unexported(worker: Any) -> dict[str, int]:
    """Spans the worker dropped (queue full, or never built) and failed to export, as its
    ``leasekit_spans_dropped_total`` reports them."""
    return {"dropped": worker._lk_provider.dropped_spans() + worker._lk_spans.dropped,
            "failed": worker._lk_provider.failed_spans() + worker._lk_spans.failed}
