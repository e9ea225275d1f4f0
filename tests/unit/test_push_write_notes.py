"""D in push mode counts a WRITE notification towards a request's KV only from the agents of the P engine the
request registered with, once per agent (leasekit/vllm/decode/writenotes.py, wired in push.py ``_get_new_notifs``).
vLLM's own ``NixlPushConnectorWorker._get_new_notifs`` does the counting here, on a LeaseKitPushWorker whose
vLLM state is set by hand (no engine); the notification intake is a recorder of drops."""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from leasekit.telemetry.lease_log import RateLimitedWarning  # noqa: E402
from leasekit.telemetry.metrics import NOTIFICATION_DROP_REASONS  # noqa: E402
from leasekit.vllm.decode.writenotes import DROP_REASONS, DUPLICATE_WRITE, FOREIGN_WRITE, WriteNoteGuard  # noqa: E402
from leasekit.vllm.push import LeaseKitPushWorker  # noqa: E402
from leasekit.vllm.stats import LeaseKitKVConnectorStats, LeaseStatsObserver  # noqa: E402

P0, P1 = "p-agent-rank0", "p-agent-rank1"


class Notes:
    """The writer thread's forwarded notifications, as PushFlow hands them to the engine thread."""

    def __init__(self):
        self.batch: dict[str, list[bytes]] = {}

    def take_notifications(self):
        batch, self.batch = self.batch, {}
        return batch


def d_worker(p_tp: int = 1):
    """A LeaseKit push D (TP 1) waiting on request ``d-1`` from P engine ``P`` (TP ``p_tp``)."""
    w = object.__new__(LeaseKitPushWorker)
    w._lk_ready = True
    w._lk_flow = Notes()
    w.drops = []
    w._lk_p = SimpleNamespace(intake=SimpleNamespace(max_bytes=4096, drain=lambda batch, now: None,
                                                      drop=lambda reason, agent, detail: w.drops.append((reason, agent))))
    w.kv_transfer_config = SimpleNamespace(is_kv_consumer=True)
    w._recving_metadata = {"d-1": SimpleNamespace(remote=SimpleNamespace(engine_id="P"), pp_size=1)}
    w._remote_agents = {"P": {(0, r): a for r, a in enumerate((P0, P1)[:p_tp])}}
    w._handshake_lock = threading.RLock()
    w._pending_completion_notifs = queue.Queue()
    w.consumer_notification_counts_by_req = defaultdict(int)
    w._recving_transfers = {}
    w._reqs_to_send, w._reqs_to_process = {}, set()
    w.world_size = 1
    w.transfer_topo = SimpleNamespace()
    w.xfer_stats = SimpleNamespace(record_notification_after_expiry=lambda: None)
    w._lk_stats = LeaseStatsObserver(LeaseKitKVConnectorStats(), 0)
    w._lk_late_warning = RateLimitedWarning(logging.getLogger("leasekit.test"))
    w._lk_writes = WriteNoteGuard()
    return w


def deliver(w, *notes):
    for agent, msg in notes:
        w._lk_flow.batch.setdefault(agent, []).append(msg)
    assert w._get_new_notifs() == set()


def test_the_write_of_the_requests_own_p_completes_it():
    w = d_worker()
    deliver(w, (P0, b"d-1:1"))
    assert "d-1" in w._recving_transfers and w.drops == []  # vLLM reports it received next


def test_a_sender_handed_as_bytes_matches_the_name_vllm_loaded_as_text():
    w = d_worker()  # nixl 1.5.1: get_new_notifs keys are bytes, add_remote_agent names are str
    deliver(w, (P0.encode(), b"d-1:1"))
    assert "d-1" in w._recving_transfers and w.drops == []


def test_a_write_notification_from_another_agent_is_dropped_and_d_keeps_waiting():
    w = d_worker()
    deliver(w, ("stranger", b"d-1:1"))
    assert "d-1" not in w._recving_transfers and w.drops == [(FOREIGN_WRITE, "stranger")]
    deliver(w, (P0, b"d-1:1"))  # the real WRITE still completes it
    assert "d-1" in w._recving_transfers


def test_a_repeat_from_one_p_rank_does_not_stand_for_the_other_ranks_write():
    w = d_worker(p_tp=2)  # P TP 2 > D TP 1: D waits for one notification from each P rank
    deliver(w, (P0, b"d-1:2"), (P0, b"d-1:2"))
    assert "d-1" not in w._recving_transfers and w.drops == [(DUPLICATE_WRITE, P0)]
    deliver(w, (P1, b"d-1:2"))
    assert "d-1" in w._recving_transfers


def test_the_guard_forgets_requests_d_no_longer_waits_on():
    guard = WriteNoteGuard()
    assert guard.admit("a", P0, {P0}) is None and guard.admit("b", P0, {P0}) is None
    assert guard.admit("a", P0, {P0}) == DUPLICATE_WRITE
    guard.prune({"b"})
    assert len(guard) == 1 and guard.admit("a", P0, {P0}) is None  # a new wait under a reused id starts clean
    assert guard.admit("a", P1, set()) == FOREIGN_WRITE  # no handshake with the request's P: nobody may complete it


def test_the_drop_reasons_are_metric_label_values():
    assert set(DROP_REASONS) <= set(NOTIFICATION_DROP_REASONS)


@given(st.lists(st.tuples(st.sampled_from([P0, P1, P1.encode(), "stranger", b"stranger", ""]),
                          st.one_of(st.binary(max_size=40),
                                    st.sampled_from([b"d-1:1", b"d-1:2", b"d-2:1", b"d-1:x", b"d-1:", b":1", b"HB:d-1"]))),
                max_size=12))
@settings(max_examples=300, deadline=None)
def test_no_notification_sequence_raises_or_completes_from_a_stranger(notes):
    w = d_worker(p_tp=2)
    deliver(w, *notes)  # never raises in D's engine step, whatever a peer sent
    senders = {a.decode() if isinstance(a, bytes) else a for a, m in notes if m.startswith(b"d-1:")}
    if "d-1" in w._recving_transfers:
        assert senders & {P0, P1}  # only P's agents complete a request D waits on
