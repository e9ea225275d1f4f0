"""P's NIXL side-channel handshake listener, made to survive bad requests.

vLLM 0.32.0 (``nixl/base_scheduler.py: _nixl_handshake_listener``) runs one thread per engine that
binds a ZMQ ``ROUTER`` socket on ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`` and answers D's
``msgpack((GET_META_MSG, pp_rank, tp_rank))`` with ``[identity, b"", encoded_data[(pp_rank, tp_rank)],
msgpack(time.perf_counter())]``. It decodes with no error handling, so one request that is not
msgpack, not a 3-element array, names an unknown rank, or arrives in other than 3 frames raises in
the thread and ends it for good: ``/health`` stays 200 but no new D can ever connect (measured,
README, "Set up and run").

:func:`serve_handshakes` is the same listener with the same wire behaviour for good requests, that
classifies every request first (:func:`check_request`), refuses a bad one, counts it by a bounded
reason (:data:`leasekit.telemetry.metrics.HANDSHAKE_BAD_REASONS`), logs a rate-limited WARNING and
keeps listening. What a bad request gets back:

- in a REQ envelope ``[identity, b"", payload...]`` (any ZMQ REQ peer, D included): one **error
  reply** ``[identity, b"", b"", msgpack(perf_counter())]``, i.e. an empty handshake payload. A REQ
  socket must get exactly one reply before it can send again, and vLLM's D
  (``nixl/base_worker.py: _nixl_handshake``) then fails its handshake at once with "Failed to decode
  NixlHandshakePayload. This likely indicates an incompatibility between connector version"
  (true: a D asking for a rank P lacks is misconfigured) instead of waiting out its 5 s receive
  timeout, and a peer that never reads replies costs P nothing (ROUTER drops replies to gone peers);
- not in a REQ envelope (a DEALER or raw peer with a non-empty second frame or only two frames): no
  reply; there is no envelope to answer into, and whoever speaks raw ZMQ owns its own timeout.

Frames above :data:`MAX_FRAME_BYTES` never reach the listener: libzmq (``ZMQ_MAXMSGSIZE``)
disconnects the peer, so memory stays bounded; those are not counted. Frames up to that size but
above :data:`MAX_REQUEST_BYTES` are counted ``oversized``. Any exception handling one request is
caught and counted ``internal_error``; a socket that fails is closed and bound again after
:data:`REBIND_DELAY_S` seconds; the thread only returns when ``stop_event`` is set.

No vLLM import here (unit-testable without an engine).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ContextManager

import msgspec
import zmq

from leasekit.telemetry.lease_log import RateLimitedWarning
from leasekit.telemetry.metrics import HANDSHAKE_BAD_REASONS

GET_META_MSG = b"get_meta_msg"
"""vLLM's handshake request tag (``nixl/metadata.py: GET_META_MSG``)."""

MAX_REQUEST_BYTES = 1024
"""Largest request frame classified further, in bytes; a good request is about 20 bytes."""

MAX_NEW_PEERS = 1024
"""Peer addresses the listener keeps between two scheduler steps (the oldest go first)."""

MAX_FRAME_BYTES = 1 << 20
"""``ZMQ_MAXMSGSIZE`` of the listener socket, in bytes: a peer sending a larger frame is disconnected
by libzmq before the frame is buffered whole (vLLM sets no limit and an unlimited receive HWM)."""

RECV_TIMEOUT_MS = 1000
"""Receive timeout in milliseconds: how often an idle listener checks ``stop_event`` (vLLM's value)."""

REBIND_DELAY_S = 1.0
"""Seconds between a failed or broken socket and the next bind attempt."""

WARN_INTERVAL_S = 10.0
"""At most one WARNING per this many seconds per listener for bad requests (and one for socket
failures), each with the count of suppressed ones."""

logger = logging.getLogger("vllm.leasekit.listener")


class ListenerHealth:
    """What one listener thread reports about itself; written by that thread only, read by others.

    Every field is an int, bool, str or None replaced whole, and ``bad`` has all its keys from the
    start (only values change), so readers need no lock under CPython.

    Attributes:
        alive: True while the socket is bound and the loop runs (False before the first bind, while
            rebinding after a socket failure, and after ``stop_event``).
        served: well-formed requests answered with handshake metadata.
        bad: refused requests by reason (every :data:`HANDSHAKE_BAD_REASONS` key, from 0).
        last_bad_reason: the reason of the latest refused request, or None.
        socket_failures: times the socket failed to bind or broke and was bound again.
        last_error: the latest socket failure or internal error as ``"Type: message"``, or None.
    """

    def __init__(self) -> None:
        self.alive = False
        self.served = 0
        self.bad: dict[str, int] = dict.fromkeys(HANDSHAKE_BAD_REASONS, 0)
        self.last_bad_reason: str | None = None
        self.socket_failures = 0
        self.last_error: str | None = None
        self.new_peers: dict[str, None] = {}
        """IP addresses (text) of the peers served since the scheduler last took them (:meth:`take_peers`),
        distinct, most recent last: one address flooding handshakes holds one entry, so it cannot push another
        D's address out before the scheduler takes them. The listener thread adds, the engine thread takes."""
        self._peers_lock = threading.Lock()

    def peer_served(self, address: str | None) -> None:
        """The listener served a handshake to a TCP peer at ``address`` (ZMQ's ``Peer-Address``; None when
        libzmq does not say). At most :data:`MAX_NEW_PEERS` distinct addresses wait (the oldest go first)."""
        if address:
            with self._peers_lock:
                peers = self.new_peers
                peers.pop(address, None)
                peers[address] = None
                if len(peers) > MAX_NEW_PEERS:
                    del peers[next(iter(peers))]

    def take_peers(self) -> list[str]:
        """Remove and return the peer addresses served since the last call (distinct, in order)."""
        if not self.new_peers:
            return []
        with self._peers_lock:
            out, self.new_peers = list(self.new_peers), {}
        return out

    def record_bad(self, reason: str) -> None:
        """Count one refused request under ``reason`` (one of :data:`HANDSHAKE_BAD_REASONS`).

        Raises:
            KeyError: ``reason`` is not a known reason (keeps the label set bounded).
        """
        self.bad[reason] = self.bad[reason] + 1
        self.last_bad_reason = reason

    def snapshot(self) -> tuple[bool, int, dict[str, int]]:
        """``(alive, served, {reason: count})`` as of now (a copy)."""
        return self.alive, self.served, dict(self.bad)


@dataclass(frozen=True)
class Checked:
    """How the listener treats one received message.

    Attributes:
        rank: ``(pp_rank, tp_rank)`` to serve, or None for a bad request.
        reason: the bad-request reason (:data:`HANDSHAKE_BAD_REASONS`), or None for a good one.
        replyable: the message came in a REQ envelope ``[identity, b"", ...]`` (gets an error reply).
        detail: a short description for the log (no payload bytes beyond 32).
    """

    rank: tuple[int, int] | None
    reason: str | None
    replyable: bool
    detail: str = ""


def _preview(data: bytes) -> str:
    return repr(bytes(data[:32])) + ("..." if len(data) > 32 else "")


def check_request(frames: list[bytes], served: Mapping[tuple[int, int], Any]) -> Checked:
    """Classify the frames a ROUTER socket received (``frames[0]`` is the peer identity ROUTER adds).

    A good request is ``[identity, b"", msgpack([GET_META_MSG, pp_rank, tp_rank])]`` with ints
    (not bools) naming a key of ``served`` (vLLM: ``encoded_data``, keyed ``(pp_rank, tp_rank)``).
    Never raises for any input.
    """
    replyable = len(frames) >= 3 and len(frames[1]) == 0
    if len(frames) != 3 or len(frames[1]) != 0:
        detail = f"{len(frames) - 1} frame(s) after the identity, not [b'', request]"
        return Checked(None, "bad_frames", replyable, detail)
    payload = frames[2]
    if len(payload) > MAX_REQUEST_BYTES:
        return Checked(None, "oversized", True, f"{len(payload)} bytes > {MAX_REQUEST_BYTES}")
    try:
        msg = msgspec.msgpack.decode(payload)
    except Exception as exc:  # msgspec.DecodeError, or anything else the decoder raises
        return Checked(None, "bad_msgpack", True, f"{type(exc).__name__}: {exc}; payload {_preview(payload)}")
    if not isinstance(msg, (list, tuple)) or len(msg) != 3:
        return Checked(None, "bad_shape", True, f"not a 3-element array: {type(msg).__name__}")
    tag, pp_rank, tp_rank = msg
    if type(pp_rank) is not int or type(tp_rank) is not int:
        return Checked(None, "bad_shape", True, f"ranks {type(pp_rank).__name__}, {type(tp_rank).__name__} not int")
    if tag != GET_META_MSG:
        return Checked(None, "unknown_tag", True, f"tag {_preview(tag) if isinstance(tag, bytes) else repr(tag)[:40]}")
    if (pp_rank, tp_rank) not in served:
        return Checked(None, "unknown_rank", True, f"rank (pp {pp_rank}, tp {tp_rank}); serving {sorted(served)}")
    return Checked((pp_rank, tp_rank), None, True)


@contextlib.contextmanager
def open_router(path: str, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Iterator[zmq.Socket]:
    """A bound ZMQ ROUTER socket on ``path`` (``tcp://host:port``, ``tcp://[v6]:port``) in its own
    context, destroyed on exit.

    As vLLM's ``nixl/utils.py: zmq_ctx(zmq.ROUTER, path)`` (``utils/network_utils.py:
    make_zmq_socket``: unlimited send/receive HWM, IPv6 when the host is, bind) plus
    ``ZMQ_MAXMSGSIZE = max_frame_bytes``, which libzmq only applies to connections of a socket
    that had it before ``bind``; vLLM's optional 0.5 GiB kernel buffers are left out (the side
    channel carries a few KiB per handshake).

    Raises:
        zmq.ZMQError: the bind failed (e.g. address in use).
    """
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if path.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(path)
        yield sock
    finally:
        ctx.destroy(linger=0)


def serve_handshakes(
    encoded_data: Mapping[tuple[int, int], bytes],
    ready_event: threading.Event,
    stop_event: threading.Event,
    path: str,
    health: ListenerHealth,
    *,
    open_socket: Callable[[str], ContextManager[zmq.Socket]] = open_router,
    clock: Callable[[], float] = time.perf_counter,
    recv_timeout_ms: int = RECV_TIMEOUT_MS,
) -> None:
    """Run the listener until ``stop_event`` is set (the body of the listener thread); never raises.

    Args:
        encoded_data: ``(pp_rank, tp_rank)`` -> encoded ``NixlHandshakePayload`` bytes (vLLM's
            ``set_xfer_handshake_metadata``).
        ready_event: set once the socket is bound, or once the first bind failed (so the engine's
            ``ready_event.wait()`` never hangs; ``health.alive`` stays False until a bind succeeds).
        stop_event: vLLM's scheduler ``_stop_event`` (set by ``shutdown``); checked at least every
            ``recv_timeout_ms`` ms.
        path: the ZMQ endpoint, ``tcp://host:port``.
        health: updated as requests are served and refused.
        open_socket: context manager yielding a bound ROUTER socket for ``path`` (default
            :func:`open_router`, which also bounds frame sizes).
        clock: the timestamp echoed to D (must be the engine process's ``perf_counter``, vLLM's clock
            for lease deadlines: D estimates the clock offset from it).
        recv_timeout_ms: how often, in milliseconds, an idle listener checks ``stop_event``.
    """
    bad_warning = RateLimitedWarning(logger, WARN_INTERVAL_S)
    socket_warning = RateLimitedWarning(logger, WARN_INTERVAL_S)
    while not stop_event.is_set():
        try:
            with open_socket(path) as sock:
                sock.setsockopt(zmq.RCVTIMEO, recv_timeout_ms)
                health.alive = True
                ready_event.set()
                try:
                    _serve(sock, encoded_data, stop_event, path, health, bad_warning, clock)
                finally:
                    health.alive = False
        except Exception as exc:  # bind failed or the socket broke: rebind, never die
            health.alive = False
            health.socket_failures += 1
            health.last_error = f"{type(exc).__name__}: {exc}"
            ready_event.set()
            socket_warning.warn(
                "LeaseKit: NIXL handshake listener on %s failed (%s); no D can connect until it is bound "
                "again, retrying in %s s", path, health.last_error, REBIND_DELAY_S,
                event="handshake_listener_failure",
            )
            stop_event.wait(REBIND_DELAY_S)
    health.alive = False


def _peer_address(frame: zmq.Frame) -> str | None:
    """The TCP peer address libzmq reports for a received frame (``Peer-Address``), or None."""
    try:
        return frame.get("Peer-Address") or None
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None


def _serve(sock: zmq.Socket, encoded_data: Mapping[tuple[int, int], bytes], stop_event: threading.Event,
           path: str, health: ListenerHealth, warning: RateLimitedWarning, clock: Callable[[], float]) -> None:
    while not stop_event.is_set():
        try:
            parts = sock.recv_multipart(copy=False)
        except zmq.Again:
            continue
        try:
            frames = [part.bytes for part in parts]
            checked = check_request(frames, encoded_data)
            if checked.rank is not None:
                reply = (frames[0], b"", encoded_data[checked.rank], msgspec.msgpack.encode(clock()))
                health.served += 1  # counted before the send, so a peer that got the reply sees the count
                health.peer_served(_peer_address(parts[-1]))
                sock.send_multipart(reply)
                continue
            health.record_bad(checked.reason or "internal_error")
            if checked.replyable:
                sock.send_multipart((frames[0], b"", b"", msgspec.msgpack.encode(clock())))
            warning.warn(
                "LeaseKit: refused a bad NIXL handshake request on %s: %s (%s)%s; bad requests so far: %s",
                path, checked.reason, checked.detail, "; sent an empty error reply" if checked.replyable else "",
                {k: v for k, v in health.bad.items() if v},
                event="handshake_bad_request", reason=checked.reason,
            )
        except zmq.ZMQError:
            raise  # the socket itself is broken: rebind
        except Exception as exc:  # a bug in our handling: drop this request, keep listening
            health.record_bad("internal_error")
            health.last_error = f"{type(exc).__name__}: {exc}"
            warning.warn("LeaseKit: internal error handling a NIXL handshake request on %s: %s",
                         path, health.last_error, event="handshake_bad_request", reason="internal_error")
