"""The fail-closed protocol's P -> D channel: ZMQ over TCP, not NIXL (docs/fail-closed.md, "Transport").

P answers D's reads with verdicts and heartbeat acknowledgements. Sent as NIXL notifications they made
P open UCX endpoints back to its D engines, which stock vLLM never does, and one P so connected
segfaulted inside UCX's peer-failure handling right after its D was SIGKILLed (seen in testing).
Over ZMQ a dead D costs P a TCP reconnect timer and a bounded send queue, and nothing D does can reach
P's UCX worker:

- D's worker binds one ZMQ ``PULL`` socket (:class:`VerdictInbox`), on the local address its kernel
  routes to each P host from (:func:`local_address_towards`) and a port the kernel picks at ``bind``
  (no window in which another binder could take it), and names that endpoint and a random token in its
  hello (a NIXL heartbeat id D -> P, the direction stock vLLM already uses): ``<endpoint> <token>``.
- P's worker keeps one ``PUSH`` socket per D agent that said hello (:class:`VerdictOutbox`), connected
  to the endpoint the hello named, and sends ``[P agent name, token, message]`` without ever blocking:
  a full queue (:data:`SEND_HWM` messages for a D that is gone or slow) raises ``zmq.Again``, which P
  counts as a failed send. ZMQ heartbeats on the connection find a silently dead peer.
- D keeps only messages that carry its own token: a message queued for an earlier D worker that had the
  same port, or sent by anyone who merely opened a TCP connection to the inbox, is dropped.

Both sockets live in the engine thread of their worker (ZMQ sockets are not thread-safe; libzmq's I/O
thread does the TCP work). No vLLM import here (unit-testable without an engine).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from leasekit.lease.codec import CONTROL_CHARS
from leasekit.lease.proof import TAG_HEX_CHARS

MAX_MESSAGE_BYTES = 64 * 1024
"""``ZMQ_MAXMSGSIZE`` of D's inbox, in bytes: a peer sending a larger frame is disconnected by libzmq. A
verdict names one request id (at most 1024 characters); P cuts an acknowledgement's id list to
:data:`MAX_ACK_BYTES`."""

MAX_ACK_BYTES = 60 * 1024
"""Largest acknowledgement P sends, in bytes: the ids beyond it are left out (an ack naming fewer leases
is still true; those reads wait for their verdict)."""

MAX_SOCKETS = 4096
"""``ZMQ_MAX_SOCKETS`` of P's and D's channel contexts (libzmq's default, 1023, would refuse new D
agents before P's cap of 1024 is reached)."""

HEARTBEAT_IVL_MS = 5000
HEARTBEAT_TIMEOUT_MS = 15000
"""ZMQ heartbeats on P's connections (``ZMQ_HEARTBEAT_IVL``/``_TIMEOUT``, milliseconds): a connection
whose peer stopped answering (a firewall dropped it, the host died) is closed and dialled again."""

REPLACED_LINGER_MS = 1000
"""Milliseconds a D agent's replaced socket may still flush what it queued (a hello naming a new endpoint)."""

ROUTE_RETRY_S = 30.0
"""Seconds D remembers that a P host had no route (or did not resolve) before asking the kernel again."""

TOKEN_HEX_CHARS = 16
"""Length of an inbox's token (64 random bits, lowercase hex)."""

SEND_HWM = 1024
"""Messages P queues per D agent (``ZMQ_SNDHWM``) while the connection is down; beyond it sends fail."""

RECEIVE_HWM = 16384
"""Messages D's inbox buffers between two engine steps (``ZMQ_RCVHWM``)."""

RECONNECT_IVL_MAX_MS = 5000
"""Longest back-off, in milliseconds, between P's reconnect attempts to a D that is gone."""

MAX_ENDPOINT_CHARS = 300
"""Longest endpoint a hello may name."""

_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[0-9.]{7,15}):(\d{1,5})")
_TOKEN = re.compile(r"[0-9a-f]{%d}" % TOKEN_HEX_CHARS)
_TAG = re.compile(r"[0-9a-f]{%d}" % TAG_HEX_CHARS)

MAX_HELLO_ID_CHARS = 512
"""Longest request id a hello's lease proof may name (the whole hello must fit one heartbeat id)."""


def check_endpoint(text: str) -> str | None:
    """Why ``text`` is not an endpoint P may connect to, or None when it is: ``tcp://<IPv4>:<port>``
    or ``tcp://[<IPv6>]:<port>`` (IP literals only: libzmq would resolve a host name in its I/O thread,
    stalling every other D's verdicts), port 1..65535, at most :data:`MAX_ENDPOINT_CHARS` characters.
    Never raises."""
    if not isinstance(text, str):
        return f"endpoint is {type(text).__name__}, not str"
    if len(text) > MAX_ENDPOINT_CHARS:
        return f"endpoint of {len(text)} characters > {MAX_ENDPOINT_CHARS}"
    match = _ENDPOINT.fullmatch(text)
    if match is None:
        return f"endpoint {text[:64]!r} is not tcp://<IPv4>:<port> or tcp://[<IPv6>]:<port>"
    bracketed, host = match.group(1).startswith("["), match.group(1).strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"endpoint host {host[:48]!r} is not an IP address"
    if bracketed != (address.version == 6):
        return f"endpoint host {host!r}: IPv6 goes in brackets, IPv4 does not"
    if address.is_unspecified or address.is_multicast:
        return f"endpoint host {host!r} is unspecified or multicast, not a D worker's address"
    if not 1 <= int(match.group(2)) <= 65535:
        return f"endpoint port {match.group(2)} not in [1, 65535]"
    return None


@dataclass(frozen=True)
class Hello:
    """A decoded hello payload: the verdict inbox's ``endpoint`` and ``token`` and, from a version-4 D, the
    lease proof: ``req_id`` (a P request id whose grant D holds) and ``tag``
    (:func:`leasekit.lease.proof.hello_tag` over the endpoint and token). A version-2/3 hello has neither."""

    endpoint: str
    token: str
    req_id: str | None = None
    tag: str | None = None


def encode_hello_payload(endpoint: str, token: str, req_id: str | None = None, tag: str | None = None) -> bytes:
    """The hello's payload: ``<endpoint> <token>`` (versions 2 and 3), or with a lease proof
    ``<endpoint> <token> <req_id> <tag>`` (version 4), UTF-8.

    Raises:
        ValueError: only one of ``req_id`` and ``tag`` given, or ``req_id`` holds a space.
    """
    if (req_id is None) != (tag is None):
        raise ValueError("a hello's lease proof needs both req_id and tag")
    if req_id is None:
        return f"{endpoint} {token}".encode("ascii")
    if not req_id or " " in req_id:
        raise ValueError(f"request id {req_id[:64]!r} is empty or holds a space")
    return f"{endpoint} {token} {req_id} {tag}".encode("utf-8")


def decode_hello_payload(payload: bytes) -> Hello | str:
    """The :class:`Hello` in a hello's payload, or the reason it is refused (a ``str``, which never quotes the
    token or tag). Never raises."""
    try:
        text = bytes(payload).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        return "hello payload is not UTF-8"
    parts = text.split(" ")
    if len(parts) not in (2, 4) or not _TOKEN.fullmatch(parts[1]):
        return f"hello payload is not '<endpoint> <{TOKEN_HEX_CHARS} hex digits>[ <request id> <tag>]'"
    problem = check_endpoint(parts[0])
    if problem is not None:
        return problem
    if len(parts) == 2:
        return Hello(parts[0], parts[1])
    if not parts[2] or CONTROL_CHARS.search(parts[2]) or len(parts[2]) > MAX_HELLO_ID_CHARS:
        return "hello's request id is empty, too long or holds a control character"
    if not _TAG.fullmatch(parts[3]):
        return f"hello's tag is not {TAG_HEX_CHARS} lowercase hex digits"
    return Hello(parts[0], parts[1], parts[2], parts[3])


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


def _context() -> zmq.Context:
    context = zmq.Context(io_threads=1)
    context.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return context


class VerdictInbox:
    """D's receiving end: one ``PULL`` socket, bound on demand once per local address, and this inbox's
    token (:attr:`token`, random), which every message must carry.

    Args:
        context: the ZMQ context to use (default: a new one, destroyed by :meth:`close`).
        route: maps a P host to the local address to bind (default :func:`local_address_towards`).
        clock: seconds (``time.monotonic``), for :data:`ROUTE_RETRY_S`.
    """

    def __init__(self, context: zmq.Context | None = None,
                 route: Callable[[str], str] = local_address_towards,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.token = secrets.token_hex(TOKEN_HEX_CHARS // 2)
        self._own_context = context is None
        self._context = context
        self._route = route
        self._clock = clock
        self._socket: zmq.Socket | None = None
        self._endpoints: dict[str, str] = {}  # local address -> bound endpoint
        self._routes: dict[str, str] = {}  # P host -> local address
        self._no_route: dict[str, tuple[float, OSError]] = {}  # P host -> (when, why), retried after ROUTE_RETRY_S

    def endpoint_for(self, peer_host: str) -> str:
        """The endpoint (``tcp://<local address>:<port>``) a P on ``peer_host`` should send to,
        binding a new one the first time a local address is needed. The route is asked once per host
        (until :meth:`forget_routes`); a failure is remembered for :data:`ROUTE_RETRY_S` seconds.

        Raises:
            OSError: no route to ``peer_host`` (or it does not resolve).
            zmq.ZMQError: the bind failed.
        """
        peer_host = str(peer_host)
        local = self._routes.get(peer_host)
        if local is None:
            failed = self._no_route.get(peer_host)
            if failed is not None and self._clock() - failed[0] < ROUTE_RETRY_S:
                raise OSError(*failed[1].args)  # a fresh one: re-raising the stored one grows its traceback
            try:
                local = self._route(peer_host)
            except OSError as exc:
                self._no_route[peer_host] = (self._clock(), exc)
                if len(self._no_route) > 4096:
                    self._no_route.clear()
                raise
            self._no_route.pop(peer_host, None)
            self._routes[peer_host] = local
        endpoint = self._endpoints.get(local)
        if endpoint is None:
            sock = self._open()
            sock.setsockopt(zmq.IPV6, 1 if ":" in local else 0)
            sock.bind(_tcp(local, "*"))
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._endpoints[local] = endpoint
        return endpoint

    def forget_routes(self) -> None:
        """Ask the kernel for each P host's route again at the next :meth:`endpoint_for` (D's address
        may have changed); endpoints already bound stay bound."""
        self._routes.clear()
        self._no_route.clear()

    def _open(self) -> zmq.Socket:
        if self._socket is None:
            if self._context is None:
                self._context = _context()
            sock = self._context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._socket = sock
        return self._socket

    def drain(self, limit: int = RECEIVE_HWM) -> tuple[list[tuple[str, bytes]], int]:
        """Every message waiting now, at most ``limit``, without blocking: ``([(P agent name, message
        bytes)], malformed count)``. A message that is not three frames, whose first frame is not UTF-8,
        or whose token is not this inbox's, is malformed (counted, dropped). Nothing before the first bind."""
        received: list[tuple[str, bytes]] = []
        malformed = 0
        if self._socket is None or not self._endpoints:
            return received, malformed
        token = self.token.encode()
        for _ in range(limit):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or not hmac.compare_digest(frames[1], token):
                malformed += 1
                continue
            try:
                received.append((frames[0].decode("utf-8"), frames[2]))
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
        self._routes.clear()


class VerdictOutbox:
    """P's sending end: one ``PUSH`` socket per D agent, connected to the endpoint of its hello. The
    caller caps the number of agents (P: 1024, below :data:`MAX_SOCKETS`) and removes one before adding
    one at the cap.

    Args:
        sender: P's own NIXL agent name, the first frame of every message (D's read gate keys verdicts
            by the P agent it read from).
        context: the ZMQ context to use (default: a new one, destroyed by :meth:`close`).
    """

    def __init__(self, sender: str, context: zmq.Context | None = None) -> None:
        self._sender = str(sender).encode()
        self._own_context = context is None
        self._context = context
        self._sockets: dict[str, tuple[str, str, zmq.Socket]] = {}  # agent -> (endpoint, token, socket)

    def connect(self, agent: str, endpoint: str, token: str) -> bool:
        """Send ``agent``'s messages to ``endpoint``, with ``token``, from now on. Returns True when the
        endpoint or token changed: then a new socket replaces the old one, which gets
        :data:`REPLACED_LINGER_MS` to flush what it queued; an unchanged hello keeps the socket (ZMQ
        heartbeats already replace a dead connection). ``connect`` is asynchronous: messages queue (up to
        :data:`SEND_HWM`) until the TCP connection is up.

        Raises:
            ValueError: ``endpoint`` fails :func:`check_endpoint`, or ``token`` is not
                :data:`TOKEN_HEX_CHARS` hex digits (the text names why).
            zmq.ZMQError: ZMQ refused the socket or the address.
        """
        problem = check_endpoint(endpoint)
        if problem is None and not _TOKEN.fullmatch(str(token)):
            problem = f"token {str(token)[:40]!r} is not {TOKEN_HEX_CHARS} lowercase hex digits"
        if problem is not None:
            raise ValueError(problem)
        current = self._sockets.get(agent)
        if current is not None and current[0] == endpoint and current[1] == token:
            return False
        if self._context is None:
            self._context = _context()
        sock = self._context.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
        except Exception:
            sock.close(linger=0)
            raise
        if current is not None:
            self._sockets.pop(agent)[2].close(linger=REPLACED_LINGER_MS)
        self._sockets[agent] = (endpoint, token, sock)
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
        _endpoint, token, sock = self._sockets[agent]
        sock.send_multipart((self._sender, token.encode(), bytes(message)), zmq.NOBLOCK)

    def remove(self, agent: str) -> None:
        """Close ``agent``'s socket (dropping what it still queues); nothing if it has none."""
        entry = self._sockets.pop(agent, None)
        if entry is not None:
            entry[2].close(linger=0)

    def __len__(self) -> int:
        return len(self._sockets)

    def close(self) -> None:
        """Close every socket (and the context, when this outbox made it). Idempotent."""
        for agent in list(self._sockets):
            self.remove(agent)
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None
