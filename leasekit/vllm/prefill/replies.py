"""P's side of the verdict channel in LeaseKitConnector (docs/fail-closed.md, docs/security.md): which D agents
said hello, and P's answers to them over ZMQ (:mod:`leasekit.vllm.verdictchan`).

A hello (the heartbeat id ``LK1~H~<base64 payload>``) from a D agent names the ZMQ endpoint of that D worker's
verdict inbox and its token and, to a P that mints lease secrets, proves a lease: a P request id and the hello
tag over endpoint and token (:func:`leasekit.lease.proof.hello_tag`). P connects only on a hello that proves a
lease it granted (else ``unproven_hello``) and names an address P allows (else ``hello_not_allowed``: by
default the addresses P's side-channel listener served handshakes to, or the networks of
``leasekit_verdict_allow``); a malformed one is ``bad_hello``; a later good one replaces it; at most :data:`MAX_PROTOCOL_AGENTS` D agents are kept, the least recently answered closed first, so P
can answer D without a NIXL (UCX) connection back to it. Every completion from such an agent is answered
with a verdict ``LK1:V:ok|reaped:<id>`` (``ok`` iff the lease was live when P handled it); ``ok`` verdicts
for an agent whose hello has not arrived yet are kept (bounded) and sent when it does. A heartbeat that
carries D's sequence token ``LK1~<n>`` is acknowledged, ``LK1:A:<n>:<remaining ms>:<ids>`` (the ids it
extended and the least time left over them; at most 60 KiB of ids).
"""

from __future__ import annotations

import ipaddress
from collections import deque
from typing import Any, Callable, Iterable

from leasekit.lease.codec import MAX_HEARTBEAT_ID_CHARS, encode_ack, encode_verdict
from leasekit.lease.peerref import peer_ref
from leasekit.lease.proof import LeaseProofs
from leasekit.telemetry.lease_log import RateLimitedWarning, lease_logger
from leasekit.vllm.verdictchan import MAX_ACK_BYTES, VerdictOutbox, decode_hello_payload

MAX_PENDING_VERDICTS_PER_AGENT = 256
"""Verdicts kept for one D agent whose hello has not arrived (the oldest go first)."""
MAX_PENDING_AGENTS = 64
"""Agents with kept verdicts (stock D agents never say hello; the oldest agent's are dropped first)."""
MAX_PROTOCOL_AGENTS = 1024
"""D agents P keeps from hellos (each holds a ZMQ socket, one TCP connection); beyond it the least recently
answered is closed (its D says hello again after one read times out)."""
MAX_ALLOWED_PEERS = 4096
"""Side-channel peer addresses P remembers as allowed verdict destinations (the oldest go first)."""


class VerdictReplies:
    """The D agents one P worker answers, and its answers (a component of LeaseKit's P worker).

    Args:
        own_agent: this worker's NIXL agent name (P's messages name it, so D's inbox knows the sender).
        stats: the lease stats observer (``verdict_send_failed``).
        drop: ``drop(reason, agent, detail)``: count and log one dropped message (``bad_hello``,
            ``unproven_hello``, ``hello_not_allowed``).
        proofs: the lease tag checker (its key None: P mints no secrets, and a hello needs no proof).
        clock_id: this worker's clock id, named in every acknowledgement (None: unknown).
        enabled: this P speaks the fail-closed protocol (``leasekit_fail_closed``); when False hellos are
            ignored, as a stock P does, and P never connects to a D nor answers one.
        allow: networks a hello's endpoint may be in (``leasekit_verdict_allow``); empty: the side-channel peers
            (:meth:`allow_peers`).

    State: :attr:`agents` (insertion-ordered set of D agents that said hello, least recently answered
    first), :attr:`pending` (agent -> kept verdicts), :attr:`outbox` (made at the first hello).
    """

    def __init__(self, own_agent: str, stats: Any, drop: Callable[[str, str, str], None],
                 proofs: LeaseProofs | None = None, *, clock_id: str | None = None, enabled: bool = True,
                 allow: Iterable[Any] = ()):
        self.own_agent, self.stats, self.drop = own_agent, stats, drop
        self.proofs = proofs if proofs is not None else LeaseProofs()
        self.clock_id, self.enabled = clock_id, enabled
        self.networks = tuple(allow)
        self.peers: dict[str, None] = {}  # side-channel peer addresses (normalised text), most recent last
        self.agents: dict[str, None] = {}
        self.pending: dict[str, deque[bytes]] = {}
        self.outbox: VerdictOutbox | None = None
        self.warning = RateLimitedWarning(lease_logger())

    def speaks(self, agent: str) -> bool:
        """Whether ``agent`` said hello (it hears verdicts and acknowledgements)."""
        return agent in self.agents

    def close(self) -> None:
        """Close every verdict socket (worker shutdown)."""
        if self.outbox is not None:
            self.outbox.close()

    def allow_peers(self, addresses: Iterable[str]) -> None:
        """Addresses P's side-channel listener served handshakes to: the verdict channel may go there (unless
        ``leasekit_verdict_allow`` names networks). Bounded (:data:`MAX_ALLOWED_PEERS`); junk is ignored."""
        for text in addresses:
            try:
                address = ipaddress.ip_address(str(text).split("%")[0])
            except ValueError:
                continue
            key = str(address.ipv4_mapped or address) if address.version == 6 else str(address)
            self.peers.pop(key, None)
            self.peers[key] = None
            if len(self.peers) > MAX_ALLOWED_PEERS:
                del self.peers[next(iter(self.peers))]

    def allowed(self, host: str) -> bool:
        """Whether a verdict channel may connect to ``host`` (an IP literal, brackets stripped)."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        if self.networks:
            return any(address in network for network in self.networks if network.version == address.version)
        if address.version == 6 and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return str(address) in self.peers

    def hello(self, agent: str, payload: bytes) -> None:
        """A D agent's hello: when it proves a lease (P mints secrets) and names an allowed address, connect
        (again) to the inbox endpoint it names, with its token, and flush the verdicts kept for it. Otherwise
        it is dropped (``bad_hello``, ``unproven_hello``, ``hello_not_allowed``) and P opens nothing. No-op
        when disabled."""
        if not self.enabled:
            return
        parsed = decode_hello_payload(payload)
        if isinstance(parsed, str):
            self.drop("bad_hello", agent, parsed)
            return
        if self.proofs.key is not None and (parsed.req_id is None or not self.proofs.hello_ok(
                parsed.req_id, parsed.endpoint, parsed.token, parsed.tag)):
            self.drop("unproven_hello", agent, "the hello proves no lease this P granted")
            return
        endpoint, token = parsed.endpoint, parsed.token
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        if self.proofs.key is not None and not self.allowed(host):  # no key: a P that mints no secrets (legacy)
            self.drop("hello_not_allowed", agent, f"verdict endpoint host {host} is not an allowed address "
                      "(a side-channel peer, or leasekit_verdict_allow)")
            return
        if self.outbox is None:
            self.outbox = VerdictOutbox(self.own_agent)
        if agent in self.agents:
            del self.agents[agent]  # most recently used last
        elif len(self.agents) >= MAX_PROTOCOL_AGENTS:  # least recently used: its D, if alive,
            # times out one read and then says hello again (decode/gate.py)
            self.unload(next(iter(self.agents)))
        try:
            changed = self.outbox.connect(agent, endpoint, token)
        except Exception as exc:
            self.drop("bad_hello", agent, f"cannot connect to {endpoint}: {type(exc).__name__}: {exc}")
            self.unload(agent)  # its old socket too: the agent is no longer answered
            return
        self.agents[agent] = None
        if changed:
            lease_logger().info("LeaseKit: D agent %s speaks the fail-closed protocol; its verdicts go to %s",
                                peer_ref(agent), endpoint)
        for msg in self.pending.pop(agent, ()):
            self._send(agent, msg)

    def unload(self, agent: str) -> None:
        """Forget D agent ``agent``: close its socket, drop the verdicts kept for it."""
        self.agents.pop(agent, None)
        self.pending.pop(agent, None)
        if self.outbox is not None:
            self.outbox.remove(agent)

    def verdict(self, agent: str, req_id: str, ok: bool) -> None:
        """Answer one completion: ``ok`` iff the lease was live; kept if the agent's hello is still due
        (only ``ok`` ones: a stock D never says hello). Nothing when disabled."""
        if not self.enabled:
            return
        if agent in self.agents:
            del self.agents[agent]  # most recently used last: the cap closes idle agents first
            self.agents[agent] = None
            self._send(agent, encode_verdict(req_id, ok))
            return
        if not ok or len(req_id) > MAX_HEARTBEAT_ID_CHARS:
            return
        msg = encode_verdict(req_id, ok)
        pending = self.pending.get(agent)
        if pending is None:
            if len(self.pending) >= MAX_PENDING_AGENTS:
                del self.pending[next(iter(self.pending))]
            pending = self.pending[agent] = deque(maxlen=MAX_PENDING_VERDICTS_PER_AGENT)
        pending.append(msg)

    def ack(self, agent: str, seq: int, extended: Iterable[str], remaining_s: float, now: float) -> None:
        """Acknowledge heartbeat ``seq`` of ``agent`` (only if it said hello): the ids it extended (cut to
        :data:`leasekit.vllm.verdictchan.MAX_ACK_BYTES`: an ack naming fewer leases is still true) and the
        least time left over them (``remaining_s``, seconds from ``now``; 0 when none was extended)."""
        if agent not in self.agents:
            return
        size, named = 0, []
        for req_id in extended:
            size += len(req_id.encode()) + 1
            if size > MAX_ACK_BYTES:
                break
            named.append(req_id)
        self._send(agent, encode_ack(seq, remaining_s, named, now, self.clock_id), ack=True)

    def _send(self, agent: str, msg: bytes, *, ack: bool = False) -> None:
        """A failed verdict is counted and logged (rate-limited), a failed acknowledgement is not: it only
        costs D its fast path, and D's own heartbeat-failure accounting sees the broken link."""
        try:
            self.outbox.send(agent, msg)  # only agents that said hello are sent to (an outbox exists)
        except Exception as exc:  # D then times out and discards the read: safe, and logged here
            if ack:
                return
            self.stats.verdict_send_failed()
            self.warning.warn(
                "LeaseKit: could not send a read verdict to D agent %s (%s: %s); D will discard that read "
                "after its verdict timeout", peer_ref(agent), type(exc).__name__, exc,
                event="verdict_send_failure", remote_agent=peer_ref(agent),
            )
