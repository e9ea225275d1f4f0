"""D's heartbeat sending in LeaseKitConnector's NIXL worker: counted, logged when it fails, the heartbeat
spans' tracking, and the chaos fault points of the send path and the forward pass.

:class:`DHeartbeatSender` is the component LeaseKit's worker owns (``_lk_dbeats``). The worker's hooks
of vllm 0.32.0 (``.../kv_connector/v1/nixl/``, :class:`leasekit.vllm.decode.hooks.DHooks`) hand it:
``_send_heartbeats`` (``base_worker.py``; stock sending, after the read gate's hello to P engines that
speak the fail-closed protocol, :mod:`leasekit.vllm.decode.gate`; with fault points enabled, batches may
be dropped, delayed or duplicated here, with real NIXL underneath) -> :meth:`DHeartbeatSender.send`; the
NIXL wrapper's ``send_notif`` (through :class:`leasekit.vllm.taps.NotificationTap`, which calls
:meth:`DHeartbeatSender.sent` per heartbeat notification); and from ``start_load_kv`` (``pull_worker.py``)
the requests D starts and stops heartbeating (:meth:`DHeartbeatSender.track`) and the forward-pass stall
(:meth:`DHeartbeatSender.apply_stall`).

:class:`DLeaseSecrets` keeps the lease secrets of D's live protected requests (the read gate owns it): the
heartbeat tag each of their ids carries on the wire, and what D's completions and hello prove
(:mod:`leasekit.lease.proof`, docs/security.md).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Iterable

from leasekit.lease.codec import MAX_HEARTBEAT_ID_CHARS
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import TAG_SEPARATOR, heartbeat_tag
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.decode.vllmstate import VllmDState
from leasekit.vllm.taps import HEARTBEAT_PREFIX as _HEARTBEAT_PREFIX
from leasekit.vllm.taps import HeartbeatBatch, WireHeartbeat, split_heartbeat
from leasekit.vllm.verdictchan import MAX_HELLO_ID_CHARS

MAX_LEASE_SECRETS = 65536
"""Live protected requests whose lease secret D keeps (beyond this the oldest is forgotten: its ids go plain)."""
MAX_HELLO_ENGINES = 4096
"""P engines whose latest lease secret D keeps for its hello (the oldest are forgotten first)."""


def _fits_hello(remote_request_id: str) -> bool:
    """Whether a hello may name ``remote_request_id`` (P's ``decode_hello_payload`` refuses a space, a control
    character, or more than :data:`leasekit.vllm.verdictchan.MAX_HELLO_ID_CHARS` characters)."""
    return (0 < len(remote_request_id) <= MAX_HELLO_ID_CHARS and remote_request_id.isprintable()
            and " " not in remote_request_id)


class DLeaseSecrets:
    """The lease secrets ``T`` of D's live protected requests (:mod:`leasekit.lease.proof`): per P request id,
    its heartbeat wire suffix ``"~" + heartbeat_tag(T)`` (computed once, at :meth:`add`) and ``T`` (for its
    completion tag); per P engine, the latest ``(P request id, T)``, which D's hello to that engine proves.
    Memory: one small tuple per live request (bounded by ``max_requests``), one per engine (``max_engines``).

    A request of a stock P, or of a LeaseKit P older than protocol version 4, has no secret: its ids stay plain.
    """

    def __init__(self, max_requests: int = MAX_LEASE_SECRETS, max_engines: int = MAX_HELLO_ENGINES):
        self._max_requests = max_requests
        self._max_engines = max_engines
        self._by_remote: dict[str, tuple[str, bytes, str]] = {}  # P request id -> (wire suffix, T, D request id)
        self._remote_of: dict[str, str] = {}  # D request id -> P request id
        self._hello: dict[str, tuple[str, bytes]] = {}  # P engine id -> (P request id, T), most recent last

    def __len__(self) -> int:
        """How many requests' secrets are kept."""
        return len(self._by_remote)

    def add(self, request_id: str, engine_id: str, remote_request_id: str, secret: bytes) -> None:
        """D request ``request_id`` reads P request ``remote_request_id`` of P engine ``engine_id`` under lease
        secret ``secret`` (16 bytes, :func:`leasekit.lease.proof.parse_secret` of the grant's token). Not kept
        when the tagged id would exceed :data:`leasekit.lease.codec.MAX_HEARTBEAT_ID_CHARS` (P refuses a
        heartbeat holding such an id: left plain, it spoils no other id of the heartbeat). The engine's hello
        proof becomes this request when its id fits a hello (printable, no space, at most
        :data:`leasekit.vllm.verdictchan.MAX_HELLO_ID_CHARS`)."""
        suffix = TAG_SEPARATOR + heartbeat_tag(secret)
        if len(remote_request_id) + len(suffix) > MAX_HEARTBEAT_ID_CHARS:
            return
        self.finish(request_id)  # a D request reads one P request
        old = self._by_remote.pop(remote_request_id, None)
        if old is not None:
            self._remote_of.pop(old[2], None)
        self._by_remote[remote_request_id] = (suffix, secret, request_id)
        self._remote_of[request_id] = remote_request_id
        while len(self._by_remote) > self._max_requests:
            _suffix, _secret, evicted = self._by_remote.pop(next(iter(self._by_remote)))
            self._remote_of.pop(evicted, None)
        if engine_id and _fits_hello(remote_request_id):
            self._hello.pop(engine_id, None)
            self._hello[engine_id] = (remote_request_id, secret)
            while len(self._hello) > self._max_engines:
                del self._hello[next(iter(self._hello))]

    def finish(self, request_id: str) -> None:
        """D request ``request_id`` finished: its P request's suffix and secret are forgotten (later ids of it
        go plain). The engine's hello proof is kept even if it names that request: P checks a hello tag with its
        engine key alone (:meth:`leasekit.lease.proof.LeaseProofs.hello_ok`), so it still proves D held a grant."""
        remote = self._remote_of.pop(request_id, None)
        if remote is not None and self._by_remote.get(remote, ("", b"", None))[2] == request_id:
            del self._by_remote[remote]

    def secret(self, remote_request_id: str) -> bytes | None:
        """``T`` of P request ``remote_request_id``, or None (no secret: plain)."""
        entry = self._by_remote.get(remote_request_id)
        return entry[1] if entry is not None else None

    def hello_proof(self, engine_id: str, prefer: str | None = None) -> tuple[str, bytes] | None:
        """``(P request id, T)`` for a hello to P engine ``engine_id``: P request ``prefer`` when it has a secret
        and fits a hello (the lease being read), else the engine's latest; None when the engine granted D no
        secret (a P older than version 4: the old hello)."""
        if prefer is not None and _fits_hello(prefer):
            secret = self.secret(prefer)
            if secret is not None:
                return prefer, secret
        return self._hello.get(str(engine_id))

    def wire_heartbeats(self, msg: bytes, limit: int) -> list[WireHeartbeat] | None:
        """The notifications that carry heartbeat ``msg`` (``b"HB:" + b",".join(ids)``): each id with a secret
        as ``<id>~<heartbeat tag>``, the others plain, split into parts of at most ``limit`` bytes
        (:func:`leasekit.vllm.taps.split_heartbeat`). None when ``msg`` goes as it is (no id has a secret and
        it fits ``limit``). Raises UnicodeDecodeError when ``msg`` is not UTF-8."""
        if not self._by_remote and len(msg) <= limit:
            return None
        ids = bytes(msg)[len(_HEARTBEAT_PREFIX):].decode("utf-8").split(",")
        by_remote = self._by_remote
        wire_ids = [rid + entry[0] if (entry := by_remote.get(rid)) is not None else rid for rid in ids]
        if len(msg) <= limit and all(w is r for w, r in zip(wire_ids, ids)):
            return None
        return split_heartbeat(ids, wire_ids, limit)



class DHeartbeatSender:
    """D's heartbeats: counts each heartbeat notification, keeps the heartbeat spans' request tracking,
    and applies the chaos fault points of the heartbeat send path and the forward pass.

    Args:
        state: vLLM's worker state (:class:`leasekit.vllm.decode.vllmstate.VllmDState`): ``remote_agents``
            (which P engine an agent belongs to) and ``tp_rank``.
        spans: :class:`leasekit.telemetry.decode_spans.HeartbeatSpanRecorder` (``track``, ``untrack``,
            ``sent``).
        stats: :class:`leasekit.vllm.stats.LeaseStatsObserver` (``heartbeat(engine, ok)``).
        errors: :class:`leasekit.vllm.taps.TelemetryErrors` (``report(where, exc)``; never raises).
        faults: :class:`leasekit.vllm.faultpoints.FaultPoints` (``enabled``, ``delayed``, ``poll()``,
            ``heartbeat_action()``, ``record_heartbeat()``, ``forward_stall()``, ``record_stall()``).
        extension_s: E, seconds: how long P waits past a missed heartbeat (named in the failure WARNING).
        warning: rate-limited WARNING for failed sends (default: one on the lease logger).
    """

    def __init__(self, state: VllmDState, *, spans: Any, stats: Any, errors: Any, faults: Any, extension_s: float,
                 warning: RateLimitedWarning | None = None):
        self._state = state
        self._spans = spans
        self._stats = stats
        self._errors = errors
        self._faults = faults
        self._extension_s = extension_s
        self._warning = warning if warning is not None else RateLimitedWarning(lease_logger())

    def sent(self, agent_name: str, notif_msg: bytes, ok: bool) -> None:
        """Count one heartbeat notification ``notif_msg`` (``b"HB:" + b",".join(ids)``, the ids as vLLM named
        them: no lease proof, no sequence token) to NIXL agent ``agent_name``, sent (``ok``) or raised: metric,
        span counts, rate-limited WARNING on failure (naming the agent by its
        :func:`~leasekit.lease.peerref.peer_ref`). The NIXL wrapper tap's callback, once per notification: a
        heartbeat split in parts (:data:`leasekit.vllm.taps.MAX_HEARTBEAT_CHUNK_BYTES`) counts once per part
        sent, each with its own ids. Never raises."""
        try:
            engine = next(
                (eid for eid, agents in self._state.remote_agents.items() if agent_name in agents.values()), "unknown"
            )
            self._stats.heartbeat(engine, ok)
            if ok:
                ids = bytes(notif_msg)[len(_HEARTBEAT_PREFIX):].decode("utf-8", "replace").split(",")
                self._spans.sent(ids)
            else:
                self._warning.warn(
                    "LeaseKit: heartbeat notification to P engine %s (NIXL agent %s) failed to send; "
                    "P will expire its leases if this persists longer than E=%s s",
                    engine, peer_ref(agent_name), self._extension_s, event="heartbeat_send_failure",
                    remote_engine_id=engine, tp_rank=self._state.tp_rank, remote_agent=agent_name,
                )
        except Exception as exc:
            self._errors.report("heartbeat", exc)

    def track(self, tracked: Iterable[Any] | None, untracked: Iterable[str] | None) -> None:
        """The requests D started (``tracked``: ``(P request id, P engine id, D request id, trace headers)``)
        and stopped (``untracked``: P request ids) heartbeating, from the scheduler's ``on_new_request`` /
        ``_stop_heartbeat`` through the connector metadata; either may be None. Never raises."""
        if tracked or untracked:
            try:
                for remote_id, remote_engine, decode_id, headers in tracked or ():
                    self._spans.track(remote_id, remote_engine_id=remote_engine, decode_request_id=decode_id,
                                      trace_headers=headers)
                for remote_id in untracked or ():
                    self._spans.untrack(remote_id)
            except Exception as exc:
                self._errors.report("track", exc)

    def apply_stall(self) -> None:
        """Chaos fault point of the forward pass: re-read the fault file and sleep the configured stall
        (seconds), recording it. Call only while ``faults.enabled``."""
        faults = self._faults
        faults.poll()
        stall = faults.forward_stall()
        if stall > 0:
            start = time.perf_counter()
            time.sleep(stall)
            faults.record_stall(start, time.perf_counter())

    def send(self, metadata: Any, stock_send: Callable[[Any], None]) -> None:
        """Send this step's heartbeats (``metadata.heartbeat_by_engine``, P engine id -> info with
        ``req_ids``) with ``stock_send`` (vLLM's ``_send_heartbeats``, ``base_worker.py``). With fault
        points enabled, due delayed batches go first, then this batch may be dropped, delayed or
        duplicated here, in the send path, with real NIXL underneath. Raises what ``stock_send`` raises."""
        faults = self._faults
        if not faults.enabled:
            stock_send(metadata)
            return
        now = time.perf_counter()
        while faults.delayed and faults.delayed[0][0] <= now:
            _, batch = faults.delayed.pop(0)
            stock_send(HeartbeatBatch(batch))
        batch = metadata.heartbeat_by_engine
        if not batch:
            return
        ids = sorted(rid for info in batch.values() for rid in info.req_ids)
        action, copies, delay = faults.heartbeat_action()
        if action == "drop":
            faults.record_heartbeat("drop", ids)
        elif action == "delay":
            frozen = {engine: copy.copy(info) for engine, info in batch.items()}
            for info in frozen.values():
                info.req_ids = set(info.req_ids)
            faults.delayed.append((now + delay, frozen))
            faults.delayed.sort(key=lambda item: item[0])
            faults.record_heartbeat("delay", ids)
        else:
            for _ in range(copies):
                stock_send(metadata)
            faults.record_heartbeat("send", ids, copies)
