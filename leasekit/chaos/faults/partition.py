"""Partitions between P's host and D's host (two hosts of a :class:`leasekit.cluster.testbed.Testbed`):
nftables rules in table ``inet leasekit`` inside ONE host's network namespace (the fault's
``target``), matching the other host by its address, so the machine's own firewall is never touched.

Paths (what is cut):

- ``all``: every IP packet between the two hosts: NIXL/UCX (KV reads and their data, notifications:
  heartbeats, completions), the NIXL side channel (handshakes), LeaseKit's verdict channel (ZMQ, P -> D).
- ``nixl``: the same except TCP connections to either server's NIXL side-channel port (conntrack's
  original destination port): handshakes still work, UCX (reads, heartbeats, completions) and the
  verdict channel do not.
- ``side_channel``: TCP to or from the ``target`` server's side-channel port, from or to the other host.
- ``http``: TCP to or from the ``target`` server's HTTP port, from anywhere (the router and the clients
  live in the root namespace; P and D speak no HTTP to each other). ``direction`` must be ``both``.

Directions: ``both`` drops every matching packet. A one-way partition (``decode_to_prefill``,
``prefill_to_decode``) drops what the sending host puts on the wire as *data*: every non-TCP packet and
every TCP segment that carries payload (``@ih,0,8`` loads the first payload byte, which only exists in
such a segment), while bare TCP control segments (ACK, SYN, FIN, RST without payload) still pass. So the
direction means what it says: with ``decode_to_prefill`` P receives nothing D sends (heartbeats,
completions, read requests, handshake requests) while P's own sends still reach D and are acknowledged
(LeaseKit's verdicts and acknowledgements; there is nothing else P sends unasked). That holds at the
TCP level; above it, D's heartbeats share UCX's TCP connections with the reads, and were measured to
stop reaching P while ``prefill_to_decode`` stalled a read (docs/chaos.md, "Partitions"). Dropping the
acknowledgements too (a one-way drop at the IP level) would stall every TCP connection between the
hosts in both directions within one retransmission timeout (about 0.2 s here): the sender in the open
direction hears no ACK, collapses its window to one segment and only retransmits what the receiver
already has; that is ``both`` after a fraction of a second, so it is not offered.

TCP also stretches a partition: segments lost during it are retransmitted with exponential back-off
(200 ms, 400 ms, 800 ms, ...), so the first one crosses up to about as long after the heal as the
partition lasted. P can thus hear nothing from D for up to about H + 2 x the partition length.

Actions: ``drop`` (silently), ``reject`` (TCP reset for TCP, ICMP administratively prohibited for the
rest: the peer's sockets fail at once; the resets and ICMP errors themselves are let through, else the
rule of the other chain would swallow them), ``loss`` (each matching packet dropped with probability
``loss_percent`` %, ``numgen random mod 100``). Random loss and delay could go through ``tc netem`` on
real hosts; the testbed's partitions use nftables only.

:func:`partition_rules` builds the rules, :func:`partition_plan` says what a partition would run
without running it, :class:`PartitionInjector` adds and removes them and counts the packets they
matched (the proof that a partition took effect). Needs root, ``ip`` and ``nft``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from leasekit.chaos.faults._common import FaultError, run, stamp

PATHS = ("all", "nixl", "side_channel", "http")
DIRECTIONS = ("both", "decode_to_prefill", "prefill_to_decode")
ACTIONS = ("drop", "reject", "loss")
ROLES = ("prefill", "decode")
DATA = "@ih,0,8 0-255"
"""nftables match for "this TCP segment carries at least one byte of payload"."""


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class PartitionSite:
    """Where a partition acts: each host's address and network namespace and each server's ports.
    Values are text as nft writes them (a plan may hold placeholders such as ``<decode address>``)."""

    prefill_address: str
    decode_address: str
    prefill_namespace: str
    decode_namespace: str
    prefill_side_channel_port: int | str
    decode_side_channel_port: int | str
    prefill_http_port: int | str
    decode_http_port: int | str

    @classmethod
    def of_pair(cls, pair) -> "PartitionSite":
        """The site of a pair started on two hosts (``pair.testbed``; a stand-in with ``address(role)``
        and ``namespace(role)`` will do for a plan). Ports not chosen yet (0) become placeholders.

        Raises:
            FaultError: the pair has no testbed (it was not started with ``launch.network_namespace = true``).
        """
        testbed = getattr(pair, "testbed", None)
        if testbed is None:
            raise FaultError("a partition needs P and D on two hosts: start the pair with launch.network_namespace = true")

        def port(role: str, kind: str) -> int | str:
            value = getattr(getattr(pair, role), f"{kind}_port", 0)
            return value or f"<{role} {kind.replace('_', '-')} port>"

        return cls(testbed.address("prefill"), testbed.address("decode"), testbed.namespace("prefill"),
                   testbed.namespace("decode"), port("prefill", "side_channel"), port("decode", "side_channel"),
                   port("prefill", "http"), port("decode", "http"))

    def address(self, role: str) -> str:
        return self.prefill_address if role == "prefill" else self.decode_address

    def namespace(self, role: str) -> str:
        return self.prefill_namespace if role == "prefill" else self.decode_namespace

    def side_channel_port(self, role: str) -> int | str:
        return self.prefill_side_channel_port if role == "prefill" else self.decode_side_channel_port

    def http_port(self, role: str) -> int | str:
        return self.prefill_http_port if role == "prefill" else self.decode_http_port


@dataclass(frozen=True)
class Rule:
    """One nftables rule of a partition: ``chain`` (``input``/``output``), the ``match`` text, and the
    ``verdict`` text; a counter sits between them (its packets prove the partition took effect)."""

    chain: str
    match: str
    verdict: str

    def text(self) -> str:
        """The ``nft -f`` line that adds it."""
        return f"add rule inet leasekit {self.chain} {self.match} counter {self.verdict}"


def _legs(target: str, direction: str) -> list[tuple[str, str, str]]:
    """(chain, sender role, receiver role) for each direction a partition cuts, seen from ``target``'s
    host: packets the other host sends come in on ``input``, the ones ``target`` sends leave on ``output``."""
    peer = "decode" if target == "prefill" else "prefill"
    legs = [("input", peer, target), ("output", target, peer)]
    if direction == "both":
        return legs
    sender = "decode" if direction == "decode_to_prefill" else "prefill"
    return [leg for leg in legs if leg[1] == sender]


def partition_rules(path: str, direction: str, action: str, loss_percent: float, target: str,
                    site: PartitionSite) -> list[Rule]:
    """The rules (to go into ``site.namespace(target)``) of one partition; see the module doc for the
    meaning of each path, direction and action.

    Args:
        path: ``all`` | ``nixl`` | ``side_channel`` | ``http``.
        direction: ``both`` | ``decode_to_prefill`` | ``prefill_to_decode``.
        action: ``drop`` | ``reject`` | ``loss``.
        loss_percent: 0..100, a whole number (used by ``loss`` only).
        target: ``prefill`` | ``decode``: the host whose namespace holds the rules (and, for
            ``side_channel``/``http``, the server whose port is cut).
        site: addresses and ports.

    Raises:
        ValueError: a value outside its allowed set or range, or ``http`` with a one-way direction.
    """
    _choice("path", path, PATHS)
    _choice("direction", direction, DIRECTIONS)
    _choice("action", action, ACTIONS)
    _choice("target", target, ROLES)
    if isinstance(loss_percent, bool) or not isinstance(loss_percent, (int, float)) or not 0 <= loss_percent <= 100 \
            or float(loss_percent) != int(loss_percent):
        raise ValueError(f"loss_percent must be a whole number in 0..100, got {loss_percent!r}")
    if path == "http" and direction != "both":
        raise ValueError(f"direction must be 'both' for path = 'http' (HTTP runs between the router and a server, "
                         f"not between P and D), got {direction!r}")
    one_way = direction != "both"
    rules: list[Rule] = []
    for chain, sender, receiver in _legs(target, direction):
        peer_match = f"ip saddr {site.address(sender)}" if chain == "input" else f"ip daddr {site.address(receiver)}"
        data = f" {DATA}" if one_way else ""
        if path in ("all", "nixl"):
            tcp = "meta l4proto tcp"
            if path == "nixl":  # connections to either side channel stay up (one ct match: nft 1.0 merges
                # two adjacent negated port matches into one, which would drop side-channel packets too)
                ports = dict.fromkeys(str(site.side_channel_port(r)) for r in ROLES)
                tcp += f" ct original proto-dst != {{ {', '.join(ports)} }}"
            if one_way or path == "nixl" or action == "reject":
                matches = [(f"{peer_match} meta l4proto != tcp", False), (f"{peer_match} {tcp}{data}", True)]
            else:
                matches = [(peer_match, False)]
        else:
            port = site.side_channel_port(target) if path == "side_channel" else site.http_port(target)
            port_match = f"tcp dport {port}" if chain == "input" else f"tcp sport {port}"
            matches = [(f"{port_match}{data}" if path == "http" else f"{peer_match} {port_match}{data}", True)]
        for match, is_tcp in matches:
            if action == "loss":
                test = "<= 99" if int(loss_percent) == 100 else f"< {int(loss_percent)}"
                rules.append(Rule(chain, f"{match} numgen random mod 100 {test}", "drop"))
            elif action == "reject" and is_tcp:  # the resets a reject sends must not be rejected in turn
                rules.append(Rule(chain, f"{match} tcp flags & rst == 0", "reject with tcp reset"))
            elif action == "reject":  # nor the ICMP errors
                rules.append(Rule(chain, match.replace("meta l4proto != tcp", "meta l4proto != { tcp, icmp }"),
                                  "reject with icmpx type admin-prohibited"))
            else:
                rules.append(Rule(chain, match, "drop"))
    return rules


def cuts_heartbeats(path: str, direction: str, action: str, loss_percent: float = 100) -> bool:
    """Whether a partition silences D's heartbeats to P completely (every one lost while it lasts):
    ``all``/``nixl`` in a direction that includes D -> P, dropped, rejected or lost at 100 %."""
    return (path in ("all", "nixl") and direction in ("both", "decode_to_prefill")
            and (action != "loss" or loss_percent >= 100))


def _setup_script(rules: list[Rule]) -> str:
    chains = sorted({r.chain for r in rules})
    return "add table inet leasekit\n" + "".join(
        f"add chain inet leasekit {c} {{ type filter hook {c} priority 0; policy accept; }}\n" for c in chains)


@dataclass
class PartitionPlan:
    """What a partition would run: ``namespace`` (the host's), ``rules``, ``duration_s``.
    ``str(plan)`` is the shell text (``nft -f`` here-document, the wait, the removal)."""

    namespace: str
    rules: list[Rule]
    duration_s: float | None = None
    description: str = ""

    def script(self) -> str:
        """The ``nft -f`` input that adds the table, chains and rules."""
        return _setup_script(self.rules) + "".join(r.text() + "\n" for r in self.rules)

    def commands(self) -> list[str]:
        """Shell lines: add the rules, wait ``duration_s``, delete them (by the handles nft echoes)."""
        lines = [f"# {self.description}"] if self.description else []
        lines.append(f"ip netns exec {self.namespace} nft --echo --handle -f - <<'EOF'\n{self.script()}EOF")
        if self.duration_s is not None:
            lines.append(f"sleep {self.duration_s:g}")
        lines += [f"ip netns exec {self.namespace} nft delete rule inet leasekit {r.chain} handle <handle of rule {i + 1}>"
                  for i, r in enumerate(self.rules)]
        return lines

    def __str__(self) -> str:
        return "\n".join(self.commands())


def partition_plan(fault, *, pair=None, site: PartitionSite | None = None) -> PartitionPlan:
    """What the partition ``fault`` would run, without running it (for ``chaos run --plan``).

    Args:
        fault: a scenario's partition fault (:class:`leasekit.chaos.schema.PartitionFault`, or anything
            with ``path``, ``direction``, ``action``, ``loss_percent``, ``target``, ``duration_s``).
        pair: the (planned) pair, for its hosts' addresses and its servers' ports; or
        site: those given directly. Neither: placeholders (``<decode address>``, ...).

    Raises:
        ValueError: the fault's fields are invalid (see :func:`partition_rules`).
        FaultError: ``pair`` has no testbed.
    """
    if site is None:
        site = PartitionSite.of_pair(pair) if pair is not None else PartitionSite(
            "<prefill address>", "<decode address>", "<prefill host namespace>", "<decode host namespace>",
            "<prefill side-channel port>", "<decode side-channel port>", "<prefill http port>", "<decode http port>")
    direction = getattr(fault, "direction", "both")
    rules = partition_rules(fault.path, direction, fault.action, fault.loss_percent, fault.target, site)
    what = f"partition {fault.path} {direction} ({fault.action}{f' {fault.loss_percent:g} %' if fault.action == 'loss' else ''}) in {fault.target}'s host"
    return PartitionPlan(site.namespace(fault.target), rules, getattr(fault, "duration_s", None), what)


@dataclass
class PartitionInjector:
    """Adds one partition's rules to ``namespace`` (atomically, one ``nft -f``), counts the packets
    they matched, removes them. ``record`` (in place): kind ``nft``, namespace, ``rules`` (text),
    ``handles``, ``packets_matched`` (at recovery), ``injected_*``/``recovered_*`` stamps (before the
    adding ``nft`` ran, after the deleting one returned) and ``in_force_*``/``lifting_*`` stamps (after
    the adding ``nft`` returned, before the deleting one ran: the rules surely held in between; on a
    loaded host each ``nft`` can take a good part of a second) (``_monotonic_s``: ``time.monotonic()``,
    ``_wall_s``: ``time.time()``), plus ``details``.
    The namespace belongs to the caller: cleanup never deletes it (nor the table, which other
    partitions may share)."""

    namespace: str
    rules: list[Rule]
    details: dict = field(default_factory=dict)
    record: dict = field(default_factory=dict)
    handles: list[tuple[str, int]] | None = None

    def _nft(self, *args: str, stdin: str | None = None) -> str:
        return run(["ip", "netns", "exec", self.namespace, "nft", *args], stdin=stdin).stdout

    def inject(self) -> None:
        """Add every rule now.

        Raises:
            FaultError: already injected, ``nft`` failed, or it did not echo one handle per rule.
        """
        if self.handles is not None:
            raise FaultError(f"partition already injected in {self.namespace} (handles {self.handles})")
        if not self.rules:
            raise FaultError("a partition needs at least one rule")
        self.record.clear()
        self.record.update({"kind": "nft", "namespace": self.namespace, **self.details,
                            "rules": [r.text() for r in self.rules]})
        stamp(self.record, "injected")
        script = _setup_script(self.rules) + "".join(r.text() + "\n" for r in self.rules)
        out = self._nft("--echo", "--handle", "-f", "-", stdin=script)
        found = [int(m.group(1)) for line in out.splitlines() if line.startswith("add rule")
                 for m in [re.search(r"# handle (\d+)\s*$", line)] if m]
        if len(found) != len(self.rules):
            raise FaultError(f"nft echoed {len(found)} rule handle(s) for {len(self.rules)} rule(s): {out!r}")
        self.handles = [(r.chain, h) for r, h in zip(self.rules, found)]
        self.record["handles"] = [h for _, h in self.handles]
        stamp(self.record, "in_force")

    def packets(self) -> int | None:
        """Packets the rules have matched so far (sum of their counters), or None if not injected or
        the namespace is gone."""
        if self.handles is None:
            return None
        try:
            listing = json.loads(self._nft("-j", "list", "table", "inet", "leasekit"))
        except (FaultError, ValueError):
            return None
        wanted = {h for _, h in self.handles}
        total = 0
        for item in listing.get("nftables", []):
            rule = item.get("rule")
            if rule and rule.get("handle") in wanted:
                total += sum(e["counter"]["packets"] for e in rule.get("expr", []) if "counter" in e)
        return total

    def recover(self) -> None:
        """Delete the rules (recording ``packets_matched`` first); no-op if not injected. A namespace
        that is already gone took the rules with it."""
        if self.handles is None:
            return
        handles, packets = self.handles, self.packets()
        self.handles = None
        self.record["packets_matched"] = packets
        stamp(self.record, "lifting")
        script = "".join(f"delete rule inet leasekit {chain} handle {h}\n" for chain, h in handles)
        try:
            self._nft("-f", "-", stdin=script)
        except FaultError:
            if packets is not None:  # the namespace is still there: the rules must go
                raise
        stamp(self.record, "recovered")

    def cleanup(self) -> None:
        """Make sure the rules are gone; idempotent."""
        self.recover()
