"""P's notification components (leasekit.vllm.prefill) over a standalone vLLM lease state: the
three payloads that crash stock P, binding, duplicates, late reads and the max-hold cap."""

import logging
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.lease import LeaseTiming
from leasekit.telemetry import semconv as sc
from leasekit.telemetry.lease_spans import LeaseSpanRecorder
from leasekit.lease.settings import NotificationConfigError, notification_settings
from leasekit.vllm.prefill.hooks import build_prefill
from leasekit.vllm.prefill.vllmstate import VllmSendState
from leasekit.vllm.stats import DROPS, LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.taps import TelemetryErrors

L = 6
TIMING = LeaseTiming.from_lease_duration(L)


class Worker:
    """P's notification components over a standalone vLLM lease state (no vLLM worker): what LeaseKit's P
    worker builds (``build_prefill``), with ``step`` playing ``_get_new_notifs``."""

    def __init__(self, max_hold_s=480.0, max_bytes=1 << 20, fail_closed=True, agent="p0"):
        self.state = VllmSendState.standalone(TIMING.extension_s)
        self.vllm_stats = self.state._worker.xfer_stats
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.recorder = LeaseSpanRecorder(provider.get_tracer("t"), engine_id="p", tp_rank=0, timing=TIMING)
        self.stats = LeaseKitKVConnectorStats()
        observer = LeaseStatsObserver(self.stats, 0)
        p = build_prefill(self.state, timing=TIMING, max_hold_s=max_hold_s, max_bytes=max_bytes, recorder=self.recorder,
                          stats=observer, errors=TelemetryErrors(logging.getLogger("t")), own_agent=agent,
                          fail_closed=fail_closed, pledge_s=0.0, clock_id=None)
        self.keeping, self.leases, self.pledges, self.replies, self.intake = p.keeping, p.leases, p.pledges, p.replies, p.intake

    @property
    def send(self):
        """vLLM's ``_reqs_to_send`` of this stand-in."""
        return self.state.reqs_to_send

    @property
    def process(self):
        """vLLM's ``_reqs_to_process`` of this stand-in."""
        return self.state.reqs_to_process

    def grant(self, req_id, now):
        self.process.add(req_id)
        self.send[req_id] = now + L
        self.leases.index([req_id], now)
        self.recorder.grant(req_id, now + L, now=now)

    def step(self, batch):
        return self.intake.drain(batch, time.perf_counter())

    def drops(self):
        return {reason: n for _, reason, n in self.stats.data.get(DROPS, [])}


@pytest.mark.parametrize("payload,reason", [
    (b"\xff\xfe\xfd", "not_utf8"),
    (b"abc", "no_colon"),
    (None, "bad_count"),  # "<live id>:<not a number>"
])
def test_payloads_that_crash_stock_p_are_dropped_and_the_batch_goes_on(payload, reason):
    w = Worker()
    w.grant("live", 0.0)
    payload = payload or b"live:x"
    done = w.step({"d0": [payload, b"live:1"]})
    assert done == {"live"}, "the well-formed completion after the bad message must still be handled"
    assert w.drops() == {reason: 1}
    assert "live" not in w.send


def test_oversized_notification_is_dropped_before_decoding():
    w = Worker(max_bytes=1024)
    w.grant("r", 0.0)
    w.step({"d0": [b"r" * 2000 + b":1"]})  # a completion over leasekit_max_notification_bytes
    assert w.drops() == {"oversized": 1}
    ceiling = w.intake.heartbeat_max_bytes()  # a heartbeat: sized to the ids a real D can name
    assert ceiling >= 1 << 20
    w.step({"d0": [b"HB:" + b"r," * (ceiling // 2) + b"r"]})
    assert w.drops() == {"oversized": 2}


def test_heartbeat_binds_and_foreign_heartbeats_do_not_extend():
    w = Worker()
    w.grant("r", 0.0)
    w.step({"d0": [b"HB:r"]})
    deadline = w.send["r"]
    assert deadline > L - 0.5  # extended from the grant's deadline to now + E (clock is perf_counter)
    w.send["r"] = 1.0
    w.step({"forger": [b"HB:r"]})
    assert w.send["r"] == 1.0
    assert w.drops() == {"foreign_heartbeat": 1}


def test_forged_completion_is_dropped_and_the_real_one_releases():
    w = Worker()
    w.grant("r", 0.0)
    w.step({"d0": [b"HB:r"]})
    assert w.step({"forger": [b"r:1"]}) == set()
    assert "r" in w.send
    assert w.step({"d0": [b"r:1"]}) == {"r"}
    assert w.drops() == {"foreign_completion": 1}
    (span,) = w.exporter.get_finished_spans()
    assert span.attributes[sc.OUTCOME] == "released" and span.attributes[sc.RETRIEVALS] == 1


def test_duplicate_completion_does_not_free_a_two_consumer_lease_early():
    w = Worker()
    w.grant("r", 0.0)
    assert w.step({"d0": [b"r:2", b"r:2"]}) == set()  # stock would free on the repeat
    assert w.drops() == {"duplicate": 1}
    assert w.step({"d1": [b"r:2"]}) == {"r"}


def test_unknown_and_late_completions():
    w = Worker()
    w.grant("r", 0.0)
    w.step({"d0": [b"r:1"]})
    w.step({"d0": [b"r:1", b"never-held:1"]})
    assert w.drops() == {"unknown_id": 1}
    assert w.vllm_stats.after_expiry == 1  # the late read, counted as vLLM does
    names = [s.name for s in w.exporter.get_finished_spans()]
    assert sc.LATE_READ_SPAN_NAME in names


def test_heartbeats_never_extend_past_max_hold():
    w = Worker(max_hold_s=10.0)
    w.grant("r", time.perf_counter() - 9.0)  # granted 9 s ago: cap = grant + 10, now + E = grant + 13
    w.grant("young", time.perf_counter())
    grant = w.recorder.grant_time("r")
    w.step({"d0": [b"HB:r,young"]})
    assert w.send["r"] == pytest.approx(grant + 10.0)
    assert w.intake.expiry_cause("r") == "max_hold"
    assert w.send["young"] < w.recorder.grant_time("young") + 10.0
    assert w.intake.expiry_cause("young") is None


def test_internal_error_drops_one_message_not_the_engine(monkeypatch):
    w = Worker()
    w.grant("r", 0.0)
    w.grant("s", 0.0)
    real = w.intake.completion
    calls = []

    def flaky(agent, message, now, done):
        calls.append(message.req_id)
        if message.req_id == "r":
            raise RuntimeError("bug")
        real(agent, message, now, done)

    monkeypatch.setattr(w.intake, "completion", flaky)
    assert w.step({"d0": [b"r:1", b"s:1"]}) == {"s"}
    assert w.drops() == {"internal_error": 1}


def test_settings_refuse_bad_values_with_the_field_and_range():
    assert notification_settings({}, 6) == (480.0, 1 << 20)
    assert notification_settings({}, 600) == (600.0, 1 << 20)  # unset: max(480, L), never refused
    assert notification_settings({}, 90000)[0] == 90000.0
    with pytest.raises(NotificationConfigError, match=r"leasekit_max_hold_s=3.*\[kv_lease_duration=6"):
        notification_settings({"leasekit_max_hold_s": 3}, 6)
    with pytest.raises(NotificationConfigError, match=r"leasekit_max_notification_bytes='big'"):
        notification_settings({"leasekit_max_notification_bytes": "big"}, 6)


def test_a_telemetry_failure_in_a_completion_leaves_no_lease_half_released():
    """vLLM's maps take the keeping's decision before any telemetry runs: a recorder that fails on the
    completion still leaves the lease released once (not left in ``_reqs_to_send``, unbound, for a forger to
    bind and the reaper to free a second time)."""
    w = Worker()
    w.grant("r", time.perf_counter())
    w.step({"d0": [b"HB:r"]})
    real, calls = w.recorder.retrieval, []

    def failing(*a, **k):
        calls.append(a)
        raise RuntimeError("telemetry bug")

    w.recorder.retrieval = failing
    assert w.step({"d0": [b"r:1"]}) == {"r"} and calls
    w.recorder.retrieval = real
    assert "r" not in w.send and "r" not in w.process and w.keeping.table.get("r") is None
    assert w.drops() == {}, "not an internal_error: the completion took effect"
    deadline = time.perf_counter() + 2 * L
    assert w.step({"forger": [b"HB:r"]}) == set() and "r" not in w.send
    reaped: set = set()
    assert w.leases.reap(w.state, reaped, lambda ds: None, deadline) == [] and reaped == set()
