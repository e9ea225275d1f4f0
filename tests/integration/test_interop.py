"""Wire compatibility: LeaseKitConnector on one side, stock NixlConnector on the other, both ways.

Each pair queues requests on D for longer than the lease, so they are served only if D's
heartbeats reach P and P understands them."""

import pytest

from leasekit.chaos.workload import QueuedDecodeLoad
from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.telemetry import metrics as m
from leasekit.telemetry.lease_timeline import read_leases
from tests.prefetch import PREFETCH
from tests.scrape import labelled

pytestmark = pytest.mark.pair
L = 6
HOLD_S = 1.5 * L


def queued_requests_survive_the_lease(pair: PDPair, n: int = 2) -> QueuedDecodeLoad:
    load = QueuedDecodeLoad(pair, requests=n)
    load.start()
    import time

    time.sleep(HOLD_S)
    load.release_slot()
    assert load.wait_decodes(120)
    for index, result in load.decodes.items():
        assert result.ok, f"request {index}: HTTP {result.status} {result.error}"
        assert len(result.token_ids) == load.decode_tokens
    return load


def _spec(prefill_connector: str, decode_connector: str) -> PairSpec:
    return PairSpec.pinned(prefill_connector=prefill_connector, decode_connector=decode_connector, lease_duration_s=L)


PREFETCH_PAIRS = [_spec("leasekit", "stock"), _spec("stock", "leasekit")]
"""Started ahead in the background (tests/prefetch.py)."""


@pytest.fixture
def pair(request, vllm_available, tmp_path):
    with PREFETCH.pair_for(_spec(*request.param), tmp_path / "run") as started:
        yield started


@pytest.mark.parametrize("pair", [("leasekit", "stock")], indirect=True)
def test_leasekit_prefill_with_stock_decode(pair):
    load = queued_requests_survive_the_lease(pair)
    import time

    deadline = time.monotonic() + 15  # spans are built and exported in the background, in batches
    while True:
        leases = {lease.request_id: lease for lease in read_leases(pair.span_dir)[0]}
        if set(load.request_ids) <= set(leases) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for rid in load.request_ids:
        lease = leases[rid]
        assert lease.outcome == "released" and lease.retrievals == 1 and lease.kv_blocks >= 1
        assert lease.heartbeat_count >= 3, "stock D's heartbeats must reach LeaseKit P"
        assert lease.end_s - lease.grant_s > L  # alive past L only through heartbeats
        assert lease.remote_agent
    assert "Releasing expired KV blocks" not in pair.prefill.log_path.read_text()
    assert "speaks the fail-closed protocol" not in pair.prefill.log_path.read_text()  # stock D: no hello
    bindings = labelled(pair.prefill.url, "leasekit_kv_lease_bindings_total", "proof")  # stock D: counted plain
    assert bindings["plain"] >= len(load.request_ids) and bindings["proven"] == 0, bindings


@pytest.mark.parametrize("pair", [("stock", "leasekit")], indirect=True)
def test_stock_prefill_with_leasekit_decode(pair):
    queued_requests_survive_the_lease(pair)
    log = pair.prefill.log_path.read_text()
    assert "Releasing expired KV blocks" not in log, "LeaseKit D's heartbeats must keep stock P's leases"
    # stock P writes no lease spans; LeaseKit D's span file holds no P-side leases
    assert read_leases(pair.span_dir)[0] == []
    # no LeaseKit protocol toward a stock P (it would crash on an LK1 message): D reads unprotected
    assert "said hello" not in pair.decode.log_path.read_text()
    reads = labelled(pair.decode.url, m.READS.sample_names[0], "outcome")
    assert reads["unprotected"] >= 2 and reads["verified"] == reads["reaped"] == reads["timeout"] == 0, reads
