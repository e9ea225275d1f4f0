"""The fail-closed protocol's P -> D channel: ZMQ over TCP, not NIXL (docs/fail-closed.md, "Transport").

P answers D's reads with verdicts and heartbeat acknowledgements. Sent as NIXL notifications they made
P open UCX endpoints back to its D engines, which stock vLLM never does, and one P so connected
segfaulted inside UCX's peer-failure handling right after its D was SIGKILLed (issue 6 stops 9-11).
Over ZMQ a dead D costs P a TCP reconnect timer and a bounded send queue, and nothing D does can reach
P's UCX worker:

- D's worker binds one ZMQ ``PULL`` socket (:class:`VerdictInbox`), on the local address its kernel
  routes to each P host from (:func:`local_address_towards`) and a port the kernel picks at ``bind``
  (no window in which another binder could take it), and names that endpoint in its hello (a NIXL
  heartbeat id D -> P, the direction stock vLLM already uses).
- P's worker keeps one ``PUSH`` socket per D agent that said hello (:class:`VerdictOutbox`), connected
  to the endpoint the hello named, and sends ``[P agent name, message]`` without ever blocking: a full
  queue (:data:`SEND_HWM` messages for a D that is gone or slow) raises ``zmq.Again``, which P counts
  as a failed send.

Both sockets live in the engine thread of their worker (ZMQ sockets are not thread-safe; libzmq's I/O
thread does the TCP work). No vLLM import here (unit-testable without an engine).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

import zmq

MAX_MESSAGE_BYTES = 64 * 1024
"""``ZMQ_MAXMSGSIZE`` of D's inbox, in bytes: a peer sending a larger frame is disconnected by libzmq. A
verdict or acknowledgement is under 1 KiB plus the request ids it names (at most 1024 characters each)."""

SEND_HWM = 1024
"""Messages P queues per D agent (``ZMQ_SNDHWM``) while the connection is down; beyond it sends fail."""

RECEIVE_HWM = 16384
"""Messages D's inbox buffers between two engine steps (``ZMQ_RCVHWM``)."""

RECONNECT_IVL_MAX_MS = 5000
"""Longest back-off, in milliseconds, between P's reconnect attempts to a D that is gone."""

MAX_ENDPOINT_CHARS = 300
"""Longest endpoint a hello may name."""

_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[0-9A-Za-z][0-9A-Za-z.-]{0,252}):(\d{1,5})")


def check_endpoint(text: str) -> str | None:
    """Why ``text`` is not an endpoint P may connect to, or None when it is: ``tcp://<host>:<port>``
    with an IPv4 address or host name, or ``tcp://[<IPv6>]:<port>``, port 1..65535, at most
    :data:`MAX_ENDPOINT_CHARS` characters. Never raises."""
    if not isinstance(text, str):
        return f"endpoint is {type(text).__name__}, not str"
    if len(text) > MAX_ENDPOINT_CHARS:
        return f"endpoint of {len(text)} characters > {MAX_ENDPOINT_CHARS}"
    match = _ENDPOINT.fullmatch(text)
    if match is None:
        return f"endpoint {text[:64]!r} is not tcp://<host>:<port>"
    if not 1 <= int(match.group(2)) <= 65535:
        return f"endpoint port {match.group(2)} not in [1, 65535]"
    return None


def local_address_towards(host: str) -> str:
    """The local IP address (text, no brackets) this host's kernel routes to ``host`` from: a UDP
    socket is ``connect``-ed to it and asked for its own address, so no packet is sent.

    Raises:
        OSError: ``host`` does not resolve or no route leads to it.
    """
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def _tcp(host: str, port: str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class VerdictInbox:
    """D's receiving end: one ``PULL`` socket, bound on demand once per local address.

    Args:
        context: the ZMQ context to use (default: a new one, destroyed by :meth:`close`).
        route: maps a P host to the local address to bind (default :func:`local_address_towards`).
    """

    def __init__(self, context: zmq.Context | None = None,
                 route: Callable[[str], str] = local_address_towards) -> None:
        self._own_context = context is None
        self._context = context
        self._route = route
        self._socket: zmq.Socket | None = None
        self._endpoints: dict[str, str] = {}  # local address -> bound endpoint

    def endpoint_for(self, peer_host: str) -> str:
        """The endpoint (``tcp://<local address>:<port>``) a P on ``peer_host`` should send to,
        binding a new one the first time a local address is needed.

        Raises:
            OSError: no route to ``peer_host``.
            zmq.ZMQError: the bind failed.
        """
        local = self._route(str(peer_host))
        endpoint = self._endpoints.get(local)
        if endpoint is None:
            sock = self._open()
            if ":" in local:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(_tcp(local, "*"))
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._endpoints[local] = endpoint
        return endpoint

    def _open(self) -> zmq.Socket:
        if self._socket is None:
            if self._context is None:
                self._context = zmq.Context(io_threads=1)
            sock = self._context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._socket = sock
        return self._socket

    def drain(self, limit: int = RECEIVE_HWM) -> tuple[list[tuple[str, bytes]], int]:
        """Every message waiting now, at most ``limit``, without blocking: ``([(P agent name, message
        bytes)], malformed count)``. A message that is not two frames, or whose first frame is not
        UTF-8, is malformed (counted, dropped). Nothing before the first bind."""
        received: list[tuple[str, bytes]] = []
        malformed = 0
        if self._socket is None or not self._endpoints:
            return received, malformed
        for _ in range(limit):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                malformed += 1
                continue
            try:
                received.append((frames[0].decode("utf-8"), frames[1]))
            except UnicodeDecodeError:
                malformed += 1
        return received, malformed

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints bound so far."""
        return tuple(self._endpoints.values())

    def close(self) -> None:
        """Close the socket (and the context, when this inbox made it). Idempotent."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None
        self._endpoints.clear()


class VerdictOutbox:
    """P's sending end: one ``PUSH`` socket per D agent, connected to the endpoint of its hello.

    Args:
        sender: P's own NIXL agent name, the first frame of every message (D's read gate keys verdicts
            by the P agent it read from).
        context: the ZMQ context to use (default: a new one, destroyed by :meth:`close`).
    """

    def __init__(self, sender: str, context: zmq.Context | None = None) -> None:
        self._sender = str(sender).encode()
        self._own_context = context is None
        self._context = context
        self._sockets: dict[str, tuple[str, zmq.Socket]] = {}

    def connect(self, agent: str, endpoint: str) -> bool:
        """Send ``agent``'s messages to ``endpoint`` from now on (a new endpoint replaces the old one).
        Returns True when the endpoint changed. ``connect`` is asynchronous: messages queue (up to
        :data:`SEND_HWM`) until the TCP connection is up.

        Raises:
            ValueError: ``endpoint`` fails :func:`check_endpoint` (the text names why).
            zmq.ZMQError: ZMQ refused the socket or the address.
        """
        problem = check_endpoint(endpoint)
        if problem is not None:
            raise ValueError(problem)
        current = self._sockets.get(agent)
        if current is not None and current[0] == endpoint:
            return False
        if self._context is None:
            self._context = zmq.Context(io_threads=1)
        sock = self._context.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
        except Exception:
            sock.close(linger=0)
            raise
        self.remove(agent)
        self._sockets[agent] = (endpoint, sock)
        return True

    def has(self, agent: str) -> bool:
        """Whether ``agent`` has an endpoint."""
        return agent in self._sockets

    def send(self, agent: str, message: bytes) -> None:
        """Queue ``message`` for ``agent`` without blocking.

        Raises:
            KeyError: ``agent`` has no endpoint.
            zmq.Again: its queue is full (the D is gone, partitioned or not reading).
        """
        self._sockets[agent][1].send_multipart((self._sender, bytes(message)), zmq.NOBLOCK)

    def remove(self, agent: str) -> None:
        """Close ``agent``'s socket (dropping what it still queues); nothing if it has none."""
        entry = self._sockets.pop(agent, None)
        if entry is not None:
            entry[1].close(linger=0)

    def __len__(self) -> int:
        return len(self._sockets)

    def close(self) -> None:
        """Close every socket (and the context, when this outbox made it). Idempotent."""
        for agent in list(self._sockets):
            self.remove(agent)
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None
