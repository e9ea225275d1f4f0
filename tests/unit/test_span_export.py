"""Span export off the engine thread: the batch processor never makes the thread that ends a span wait
for an exporter (blocked forever, a full disk, a frozen write, an OTLP endpoint that never answers),
and every span is accounted for (exported, failed, queued, in an export, or dropped and counted).

Hangs are detected by running the blocking call in a thread joined with a generous timeout; no test
asserts a duration."""

import errno
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from leasekit.telemetry.batching import BatchSettings, CountingBatchSpanProcessor
from leasekit.telemetry.provider import SPAN_FILE_BATCH, TelemetryConfigError, build_tracer_provider, otlp_batch_settings
from leasekit.telemetry.spanfile import read_span_dir

HANG_S = 60.0  # a call that has not returned after this long is taken as hung
# Shutdown here waits at most 0.5 s (or the OTLP exporter's 2 s timeout); the SDK's BatchSpanProcessor
# alone would wait 30 s for a blocked worker (``BatchProcessor.shutdown(timeout_millis=30000)``), so a
# shutdown still running after 20 s did not apply our bound. A hang detector, not a speed goal.
SHUTDOWN_HANG_S = 20.0


def finishes(fn, timeout_s: float = HANG_S) -> bool:
    """Run ``fn`` in a thread; whether it returned within ``timeout_s`` (re-raises its exception)."""
    errors = []

    def target():
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return not thread.is_alive()


def end_spans(provider, n: int, prefix: str = "s") -> None:
    tracer = provider.get_tracer("test")
    for i in range(n):
        tracer.start_span(f"{prefix}{i}").end()


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


def balanced(c) -> bool:
    return c.ended == c.queued + c.exporting + c.exported + c.failed + c.dropped_queue_full + c.dropped_shutdown


class BlockedExporter(SpanExporter):
    """An exporter whose export() blocks until ``release`` is set (never, unless the test sets it)."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[int] = []

    def export(self, spans):
        self.batches.append(len(spans))
        self.entered.set()
        self.release.wait()
        return SpanExportResult.SUCCESS


def counting_provider(exporter, settings):
    provider = TracerProvider(shutdown_on_exit=False)
    processor = CountingBatchSpanProcessor(exporter, sink="test", settings=settings)
    provider.add_span_processor(processor)
    return provider, processor


def test_ending_spans_never_waits_for_a_blocked_exporter_and_every_drop_is_counted(caplog):
    settings = BatchSettings(max_queue_size=256, schedule_delay_s=0.02, max_export_batch_size=64,
                             export_timeout_s=1.0, shutdown_timeout_s=0.5)
    exporter = BlockedExporter()
    provider, processor = counting_provider(exporter, settings)
    caplog.set_level(logging.WARNING)
    end_spans(provider, 1, "first")
    assert exporter.entered.wait(HANG_S), "the background thread never called export"
    assert exporter.batches == [1]  # the background thread now blocks forever inside export()

    assert finishes(lambda: end_spans(provider, 5000)), "ending spans waited for the blocked exporter"
    c = processor.counts()
    assert (c.ended, c.exporting, c.queued, c.exported, c.failed) == (5001, 1, 256, 0, 0)
    assert c.dropped_queue_full == 5001 - 1 - 256 and c.dropped_shutdown == 0 and balanced(c)
    # our admission bound kept the SDK's own queue from overflowing: it never dropped silently
    assert not [r for r in caplog.records if "Queue full" in r.getMessage()]

    assert finishes(processor.shutdown, SHUTDOWN_HANG_S), "shutdown waited for the blocked exporter"
    c = processor.counts()
    assert (c.queued, c.exporting, c.dropped_shutdown) == (0, 1, 256) and balanced(c)
    end_spans(provider, 3, "late")  # after shutdown: counted, not queued
    assert processor.counts().dropped_shutdown == 259
    exporter.release.set()  # the export in flight returns: its span counts as exported
    wait_for(lambda: processor.counts().exporting == 0, "the released export to return")
    c = processor.counts()
    assert (c.ended, c.exported, c.dropped) == (5004, 1, 5003) and balanced(c)


def test_spans_are_in_the_span_file_after_shutdown_none_dropped(tmp_path):
    provider, sinks = build_tracer_provider(run_dir=tmp_path, file_stem="p", resource_attributes={}, env={})
    end_spans(provider, 1500)  # below the queue size: nothing may be dropped however slow the writer
    provider.shutdown()
    (c,) = provider.span_export_counts().values()
    assert (c.sink, c.ended, c.exported, c.dropped, c.failed) == ("file", 1500, 1500, 0, 0) and balanced(c)
    result = read_span_dir(tmp_path / "spans")
    assert sorted(s.name for s in result.spans) == sorted(f"s{i}" for i in range(1500))
    assert result.bad_lines == 0 and result.incomplete_tails == 0
    assert provider.dropped_spans() == 0 and provider.failed_spans() == 0


CHILD = """
import sys, time
from leasekit.telemetry.provider import build_tracer_provider
provider, _ = build_tracer_provider(run_dir=sys.argv[1], file_stem="child", resource_attributes={}, env={})
tracer = provider.get_tracer("child")
for i in range(int(sys.argv[2])):
    tracer.start_span(f"c{i}").end()
if sys.argv[3] == "flush-then-wait":
    assert provider.force_flush()
    print("flushed", flush=True)
    time.sleep(600)
"""


def test_a_process_that_exits_normally_loses_no_span(tmp_path):
    """No shutdown call: the SDK's atexit hook shuts the provider down and the queue is written."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), "1500", "exit"], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = read_span_dir(tmp_path / "spans")
    assert len(result.spans) == 1500 and result.incomplete_tails == 0


def test_a_sigkill_after_force_flush_loses_no_flushed_span(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "300", "flush-then-wait"],
                             cwd=Path(__file__).parents[2], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "flushed"
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        child.kill()
    result = read_span_dir(tmp_path / "spans")
    assert len(result.spans) == 300 and result.incomplete_tails == 0


def test_a_span_file_on_a_full_device_counts_failures_and_raises_nothing(tmp_path, caplog):
    """/dev/full: every write fails with ENOSPC (no privileges needed)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    (tmp_path / "spans").mkdir()
    (tmp_path / "spans" / f"p-{os.getpid()}.jsonl").symlink_to("/dev/full")
    provider, _ = build_tracer_provider(run_dir=tmp_path, file_stem="p", resource_attributes={}, env={})
    caplog.set_level(logging.WARNING, logger="leasekit.telemetry.spanfile")
    for _ in range(3):
        end_spans(provider, 10)
        assert provider.force_flush()  # runs the failing export; nothing raises
    provider.shutdown()
    (c,) = provider.span_export_counts().values()
    assert (c.ended, c.failed, c.exported, c.dropped) == (30, 30, 0, 0) and balanced(c)
    assert provider.failed_spans() == 30
    warnings = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0]  # one warning per run of failures


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (needs root and CAP_SYS_ADMIN; skipped otherwise)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_span_file_on_a_full_filesystem_fails_counted_then_recovers(tiny_tmpfs):
    provider, _ = build_tracer_provider(run_dir=tiny_tmpfs, file_stem="p", resource_attributes={}, env={})
    filler = tiny_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"x" * 1024)
    assert full.value.errno == errno.ENOSPC
    os.truncate(filler, filler.stat().st_size - 4096)  # one page free: the next line is written in part
    end_spans(provider, 50, "lost")
    assert provider.force_flush()
    assert provider.failed_spans() == 50 and provider.dropped_spans() == 0
    assert 0 < (tiny_tmpfs / "spans" / f"p-{os.getpid()}.jsonl").stat().st_size <= 4096  # a torn line
    filler.unlink()  # space again: later spans are written and readable after the failed ones
    end_spans(provider, 10, "kept")
    provider.shutdown()
    (c,) = provider.span_export_counts().values()
    assert (c.ended, c.failed, c.exported) == (60, 50, 10) and balanced(c)
    result = read_span_dir(tiny_tmpfs / "spans")
    assert sorted(s.name for s in result.spans) == sorted(f"kept{i}" for i in range(10))
    assert result.bad_lines == 1 and result.incomplete_tails == 0  # the torn line is one bad line, apart


def test_a_write_blocked_forever_does_not_block_ending_spans_or_shutdown(tmp_path):
    """A frozen filesystem, reproduced by a FIFO whose reader never reads: once its buffer is full
    every write blocks inside the kernel."""
    (tmp_path / "spans").mkdir()
    fifo = tmp_path / "spans" / f"p-{os.getpid()}.jsonl"  # the span file build_tracer_provider opens
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)  # one page: the second batch's line no longer fits
        provider, _ = build_tracer_provider(run_dir=tmp_path, file_stem="p", resource_attributes={}, env={})

        def counts():
            return provider.span_export_counts()["file"]

        def stuck() -> bool:
            c = counts()
            return c.exporting > 0 and c.dropped_queue_full > 0

        def end_until_stuck():
            for _ in range(2000):
                end_spans(provider, 50)
                if stuck():
                    return

        assert finishes(end_until_stuck), "ending spans waited for the blocked write"
        assert stuck() and balanced(counts())
        assert finishes(provider.shutdown, SHUTDOWN_HANG_S), "shutdown waited for the blocked write"
        c = counts()
        assert c.exporting > 0 and c.queued == 0 and c.dropped_shutdown > 0 and balanced(c)
    finally:
        os.close(reader)  # a write blocked on the full pipe now fails with EPIPE
    wait_for(lambda: counts().exporting == 0, "the blocked write to fail")
    c = counts()
    assert c.failed > 0 and balanced(c)  # failed, not exported: that write was still blocked at close


@pytest.fixture
def silent_endpoint():
    """A TCP server on 127.0.0.1 that accepts connections and never reads or answers."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    connected = threading.Event()
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            accepted.append(conn)
            connected.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], connected
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    server.close()


def test_an_otlp_endpoint_that_never_answers_blocks_neither_spans_nor_shutdown(silent_endpoint, monkeypatch):
    port, connected = silent_endpoint
    # 32 batches of 64 queued, each export hanging 2 s: draining them all would take over a minute
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
           "OTEL_BSP_SCHEDULE_DELAY": "20", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64"}
    for key, value in env.items():  # the OTLP exporter reads the process environment itself
        monkeypatch.setenv(key, value)
    provider, sinks = build_tracer_provider(run_dir=None, file_stem="x", resource_attributes={}, env=env)
    assert sinks == [f"otlp:http://127.0.0.1:{port}"]
    end_spans(provider, 1, "first")
    assert connected.wait(HANG_S), "the exporter never connected"
    assert finishes(lambda: end_spans(provider, 5000)), "ending spans waited for the silent endpoint"
    assert finishes(provider.shutdown, SHUTDOWN_HANG_S), "shutdown waited past the exporter's timeout"
    wait_for(lambda: provider.span_export_counts()["otlp"].exporting == 0, "the export in flight to time out")
    c = provider.span_export_counts()["otlp"]
    assert c.ended == 5001 and c.exported == 0 and c.failed >= 1 and c.dropped > 0 and balanced(c)
    assert provider.dropped_spans() == c.dropped and provider.failed_spans() == c.failed


def test_otlp_batching_follows_the_standard_variables():
    s = otlp_batch_settings({"OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_BSP_MAX_QUEUE_SIZE": "100",
                             "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10", "OTEL_BSP_EXPORT_TIMEOUT": "1500",
                             "OTEL_EXPORTER_OTLP_TIMEOUT": "3"})
    assert (s.schedule_delay_s, s.max_queue_size, s.max_export_batch_size, s.export_timeout_s, s.shutdown_timeout_s) == (
        0.25, 100, 10, 1.5, 3.0)
    d = otlp_batch_settings({"OTEL_EXPORTER_OTLP_TIMEOUT": "3", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "4"})
    assert (d.schedule_delay_s, d.max_queue_size, d.max_export_batch_size, d.shutdown_timeout_s) == (5.0, 2048, 512, 4.0)


@pytest.mark.parametrize("env, match", [
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE='0': must be an integer >= 1"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY='soon': must be a number > 0"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "8", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "9"}, r"must be <= OTEL_BSP_MAX_QUEUE_SIZE \(8\)"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, "OTEL_EXPORTER_OTLP_TIMEOUT='-1'"),
])
def test_bad_batch_variables_are_refused_at_start_naming_the_variable(env, match):
    with pytest.raises(TelemetryConfigError, match=match):
        build_tracer_provider(run_dir=None, file_stem="x", resource_attributes={},
                              env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", **env})


@pytest.mark.parametrize("field, value, match", [
    ("max_queue_size", 0, "max_queue_size=0: must be >= 1"),
    ("max_export_batch_size", 4096, r"max_export_batch_size=4096: must be in 1 .. max_queue_size \(2048\)"),
    ("schedule_delay_s", 0.0, "schedule_delay_s=0.0: must be > 0 seconds"),
    ("shutdown_timeout_s", -1.0, "shutdown_timeout_s=-1.0: must be > 0 seconds"),
])
def test_batch_settings_out_of_range_are_refused(field, value, match):
    fields = {f: getattr(SPAN_FILE_BATCH, f) for f in SPAN_FILE_BATCH.__dataclass_fields__}
    with pytest.raises(ValueError, match=match):
        BatchSettings(**{**fields, field: value})
