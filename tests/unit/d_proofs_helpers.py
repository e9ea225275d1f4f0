"""A hooked D worker with LeaseKit's read gate and tap, and P's verifier, shared by the test_d_proofs_* modules."""

from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasekit.lease.proof import LeaseProofs, lease_secret, secret_text
from leasekit.vllm.decode.gate import DReadGate
from leasekit.vllm.decode.hooks import DHooks
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseStatsObserver
from leasekit.vllm.taps import NotificationTap

KEY = bytes(range(32))
"""P engine ``P-engine``'s key (its secrets are ``lease_secret(KEY, P request id)``)."""
P = LeaseProofs(KEY)
AGENT = "p0-agent-name"


def secret_of(rid, key=KEY):
    return secret_text(lease_secret(key, rid))


def entry(d_id, p_id, engine="P-engine", secret=True, marker=4, key=KEY):
    """One ``leasekit_protected`` entry of the scheduler's contract (7 fields)."""
    return [d_id, engine, "127.0.0.1", None, p_id, secret_of(p_id, key) if secret else None, marker]


class RawWire:
    """NIXL's ``send_notif``, recording ``(agent, bytes)``; ``fail_at``: the 1-based send that raises."""

    def __init__(self, fail_at=None):
        self.sent = []
        self.fail_at = fail_at

    def send_notif(self, agent, notif_msg):
        if self.fail_at is not None and len(self.sent) + 1 == self.fail_at:
            self.fail_at = None
            raise RuntimeError("NIXL send failed")
        self.sent.append((agent, bytes(notif_msg)))


class StockD:
    """vLLM's D worker as the gate sees it; ``_read_blocks`` records the keyword arguments it got."""

    def __init__(self):
        self.tp_rank = 0
        self._remote_agents = {"P-engine": {(0, 0): AGENT}, "P-old": {(0, 0): "q0"}}
        self._recving_transfers: dict = {}
        self._recving_metadata: dict = {}
        self._recv_failures: set[str] = set()
        self.raw = RawWire()
        self.reads: list[dict] = []

    def _read_blocks(self, **kwargs):
        self.reads.append(kwargs)
        return True


class HookedD(DHooks, StockD):
    _lk_ready = True


class Raise:
    def report(self, where, exc):
        raise exc


_GATES: list[DReadGate] = []


@pytest.fixture(autouse=True)
def _close_gates():
    """Close every gate a test built, even when it failed (an open ZMQ socket would block the exit)."""
    yield
    while _GATES:
        _GATES.pop().close()


def make_d(errors=None):
    """A hooked D worker whose NIXL wrapper is LeaseKit's tap (rewrite: the gate's), as the connector builds it."""
    worker = HookedD()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reported = []
    worker.nixl_wrapper = NotificationTap(worker.raw, lambda agent, msg, ok: reported.append((agent, bytes(msg), ok)))
    gate = worker._lk_gate = DReadGate(
        VllmDState(worker), timeout_s=6.0, lease_duration_s=6.0, tracer=provider.get_tracer("t"),
        stats=LeaseStatsObserver(LeaseKitKVConnectorStats(), 0), errors=errors or Raise(),
        faults=SimpleNamespace(enabled=False), drop=lambda *a: None, context_of=lambda rid: None,
    )
    worker.nixl_wrapper.rewrite = gate.sequence_heartbeat
    _GATES.append(gate)
    return SimpleNamespace(worker=worker, gate=gate, wire=worker.raw, reported=reported, exporter=exporter)


def read(d, request_id="d1", remote="P1", engine="P-engine", consumers=1):
    return d.worker._read_blocks(request_id=request_id, remote_request_id=remote, dst_engine_id=engine,
                                 read_spec=SimpleNamespace(remote_rank=0), expected_consumers=consumers)
