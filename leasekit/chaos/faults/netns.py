"""Network faults on real TCP/UDP: a network namespace per test, nftables rules inside it.

:class:`NetworkNamespace` creates ``lk-<id>`` with ``lo`` up and a veth pair to the host (host
side ``lkh<id>``, namespace side ``lkn<id>``) on a free /30 of ``10.237.0.0/16``. Processes run
inside via :meth:`NetworkNamespace.exec_prefix`; the host reaches them at ``ns_ip``. Rules live
in table ``inet leasekit`` *inside* the namespace only, so the host's firewall is never touched.
:class:`leasekit.chaos.faults.nft.NftFault` wraps one block/loss rule as an injector. Needs root,
``ip`` and ``nft``.

Partitions between two hosts of a :class:`leasekit.cluster.testbed.Testbed` (P's and D's) live in
:mod:`leasekit.chaos.faults.partition`; :func:`partition_plan` (re-exported here) says what one would
run without running it.
"""

from __future__ import annotations

import fcntl
import re
import uuid
from typing import Self

from leasekit.chaos.faults._common import FaultError, claim, owned_by_another_live_process, run, unclaim
from leasekit.chaos.faults._netlink import (
    ACTIONS,
    CHAINS,
    ID_RE,
    LOCK_PATH,
    MATCHES,
    PREFIX,
    PROTOCOLS,
    TABLE,
    check_choice,
    check_int,
    free_subnet,
    namespaces,
    ns_pids,
    teardown,
)
from leasekit.chaos.faults.partition import PartitionPlan, partition_plan
from leasekit.cluster.testbed import LINK_PREFIX as TESTBED_LINK_PREFIX
from leasekit.cluster.testbed import TestbedError, cleanup_stale_testbeds, list_testbed_leftovers


class NetworkNamespace:
    """A network namespace ``lk-<id>`` joined to the host by a veth pair on a /30.

    Attributes: ``name``, ``host_if`` (``lkh<id>``), ``ns_if`` (``lkn<id>``), ``host_ip`` and
    ``ns_ip`` (dotted strings). Created by the constructor (undone if any step fails); use as a
    context manager or call :meth:`destroy` (idempotent).

    Args:
        short_id: 1-12 chars of ``[a-z0-9]``; default 8 random hex digits.

    Raises:
        ValueError: ``short_id`` malformed.
        FaultError: a step failed (the message has the command and its stderr).
    """

    def __init__(self, short_id: str | None = None):
        short_id = uuid.uuid4().hex[:8] if short_id is None else short_id
        if not isinstance(short_id, str) or not ID_RE.match(short_id):
            raise ValueError(f"short_id must be 1-12 characters of [a-z0-9], got {short_id!r}")
        self.short_id = short_id
        self.name, self.host_if, self.ns_if = f"{PREFIX}{short_id}", f"lkh{short_id}", f"lkn{short_id}"
        self._rules: dict[int, str] = {}
        self._table_ready = False
        self.destroyed = False
        self._created = self._link_created = False  # never tear down what is not ours
        run(["ip", "netns", "add", self.name])
        self._created = True
        claim(self.name)
        try:
            run(["ip", "-n", self.name, "link", "set", "lo", "up"])
            with open(LOCK_PATH, "w") as lock:  # one allocation at a time on this host
                fcntl.flock(lock, fcntl.LOCK_EX)
                subnet = free_subnet()
                host, peer = list(subnet.hosts())
                self.host_ip, self.ns_ip = str(host), str(peer)
                run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if])
                self._link_created = True
                run(["ip", "addr", "add", f"{host}/30", "dev", self.host_if])
            run(["ip", "link", "set", self.ns_if, "netns", self.name])
            run(["ip", "-n", self.name, "addr", "add", f"{peer}/30", "dev", self.ns_if])
            run(["ip", "-n", self.name, "link", "set", self.ns_if, "up"])
            run(["ip", "link", "set", self.host_if, "up"])
        except BaseException:
            self.destroy()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside: ``["ip", "netns", "exec", name]``."""
        return ["ip", "netns", "exec", self.name]

    def pids(self) -> list[int]:
        """Pids of the live processes inside the namespace."""
        return ns_pids(self.name)

    def _nft(self, *args: str, stdin: str | None = None) -> str:
        if self.destroyed:
            raise FaultError(f"network namespace {self.name} was destroyed")
        return run([*self.exec_prefix(), "nft", *args], stdin=stdin).stdout

    def _ensure_table(self) -> None:
        if self._table_ready:
            return
        chains = "".join(
            f"add chain inet leasekit {c} {{ type filter hook {c} priority 0; policy accept; }}\n"
            for c in CHAINS)
        self._nft("-f", "-", stdin=f"add table inet leasekit\n{chains}")
        self._table_ready = True

    def _add_rule(self, chain: str, match: list[str], verdict: list[str]) -> int:
        self._ensure_table()
        # a counter before the verdict: rule_packets() proves the rule really matched traffic
        out = self._nft("--echo", "--handle", "add", "rule", *TABLE, chain, *match, "counter", *verdict)
        found = re.search(r"# handle (\d+)", out)
        if not found:
            raise FaultError(f"nft did not report a rule handle: {out!r}")
        handle = int(found.group(1))
        self._rules[handle] = chain
        return handle

    def block(self, port: int, *, action: str = "drop", chain: str = "input",
              protocol: str = "tcp", match: str = "dport") -> int:
        """Drop (silently: connects time out) or reject (TCP reset / ICMP unreachable: refused
        at once) packets whose ``match`` port is ``port``, in the namespace's ``chain``.

        ``chain="input", match="dport"`` (default) blocks traffic to a server inside; use
        ``chain="output"`` with ``dport`` for what the namespace sends to a peer's ``port``.
        Returns the nftables rule handle (for :meth:`unblock`).

        Raises:
            ValueError: port not 1..65535, or action/chain/protocol/match not allowed.
        """
        check_int("port", port, 1, 65535)
        check_choice("action", action, ACTIONS)
        check_choice("chain", chain, CHAINS)
        check_choice("protocol", protocol, PROTOCOLS)
        check_choice("match", match, MATCHES)
        verdict = ["drop"] if action == "drop" else (
            ["reject", "with", "tcp", "reset"] if protocol == "tcp" else ["reject"])
        return self._add_rule(chain, [protocol, match, str(port)], verdict)

    def loss(self, port: int, percent: int, *, chain: str = "input", protocol: str = "tcp",
             match: str = "dport") -> int:
        """Drop each matching packet with probability ``percent``/100
        (``numgen random mod 100 < percent``; 100 is written ``<= 99``, 0 never matches).

        Returns the rule handle. Raises ValueError: port not 1..65535, percent not an int in
        0..100, or chain/protocol/match not allowed.
        """
        check_int("port", port, 1, 65535)
        check_int("percent", percent, 0, 100)
        check_choice("chain", chain, CHAINS)
        check_choice("protocol", protocol, PROTOCOLS)
        check_choice("match", match, MATCHES)
        # numgen yields 0..99 and nft rejects the constant 100: 100 % is written "<= 99"
        test = ["<=", "99"] if percent == 100 else ["<", str(percent)]
        return self._add_rule(chain, [protocol, match, str(port), "numgen", "random", "mod", "100", *test], ["drop"])

    def unblock(self, handle: int) -> None:
        """Delete one rule made by :meth:`block`/:meth:`loss`.

        Raises:
            KeyError: ``handle`` is not a live rule of this namespace.
        """
        if handle not in self._rules:
            raise KeyError(f"handle {handle!r} is not a live rule of {self.name} (have {sorted(self._rules)})")
        self._nft("delete", "rule", *TABLE, self._rules[handle], "handle", str(handle))
        del self._rules[handle]

    def rule_packets(self, handle: int) -> int | None:
        """Packets rule ``handle`` has matched so far (its nftables counter), or None if unknown."""
        if self.destroyed or handle not in self._rules:
            return None
        out = self._nft("-a", "list", "chain", *TABLE, self._rules[handle])
        for line in out.splitlines():
            if line.rstrip().endswith(f"# handle {handle}"):
                found = re.search(r"counter packets (\d+)", line)
                return int(found.group(1)) if found else None
        return None

    def rules(self) -> dict[int, str]:
        """Live rules: ``{handle: chain}``."""
        return dict(self._rules)

    def clear_rules(self) -> None:
        """Delete table ``inet leasekit`` (every rule) inside the namespace; idempotent."""
        if self._table_ready and not self.destroyed:
            self._nft("delete", "table", *TABLE)
        self._table_ready = False
        self._rules.clear()

    def destroy(self) -> None:
        """SIGKILL every process inside, delete the host veth and the namespace; idempotent.

        Raises:
            FaultError: something survived (the message says what); a retry may succeed.
        """
        if self._created:
            teardown(self.name, self.host_if if self._link_created else None)
            unclaim(self.name)
        self._rules.clear()
        self._table_ready = False
        self.destroyed = True


def list_leftovers(prefix: str = PREFIX) -> dict[str, list[str]]:
    """``{"namespaces": [...], "links": [...]}``: namespaces named ``prefix*`` (two-host testbeds'
    ``lk-<id>-<host>`` included) and host links of their veth naming (``lkh``/``lkn`` + the id part of
    ``prefix``) or of a testbed (bridge and veths ``lkt`` + the id part) still present.

    Raises:
        ValueError: ``prefix`` does not start with ``lk-``.
    """
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r} (only leasekit's namespaces), got {prefix!r}")
    id_part = prefix.removeprefix(PREFIX)
    links = []
    for line in run(["ip", "-o", "link"]).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith((f"lkh{id_part}", f"lkn{id_part}", f"{TESTBED_LINK_PREFIX}{id_part}")):
            links.append(link)
    return {"namespaces": [n for n in namespaces() if n.startswith(prefix)], "links": links}


def _testbed_part(name: str) -> bool:
    return name.startswith(TESTBED_LINK_PREFIX) or bool(re.match(r"^lk-[0-9a-f]{6}-", name))


def cleanup_stale_namespaces(prefix: str = PREFIX) -> list[str]:
    """Remove a crashed run's leftovers: namespaces ``prefix*`` (their processes killed), host veths
    of that naming, and two-host testbeds (:func:`leasekit.cluster.testbed.cleanup_stale_testbeds`).
    Returns what was removed.

    Namespaces and testbeds another live leasekit process made (see ``_common.claim``) are left alone.

    Raises:
        ValueError: ``prefix`` does not start with ``lk-``.
        FaultError: something could not be removed.
    """
    removed = []
    in_use = set()
    found = list_leftovers(prefix)  # validates prefix
    id_part = prefix.removeprefix(PREFIX)
    if re.match(r"^[0-9a-f]{0,6}$", id_part):
        try:
            removed += cleanup_stale_testbeds(id_part)
        except TestbedError as exc:
            raise FaultError(str(exc)) from None
    for name in found["namespaces"]:
        if _testbed_part(name):  # the testbed sweep above owns these
            continue
        if owned_by_another_live_process(name):  # another run, still going
            in_use.update({name, f"lkh{name[len(PREFIX):]}", f"lkn{name[len(PREFIX):]}"})
            continue
        teardown(name, f"lkh{name[len(PREFIX):]}")
        unclaim(name)
        removed.append(name)
    for link in list_leftovers(prefix)["links"]:  # e.g. a pair created before it was moved in
        if link in in_use or _testbed_part(link):
            continue
        run(["ip", "link", "del", "dev", link], check=False)
        removed.append(link)
    left = list_leftovers(prefix)
    live_testbeds = {n for names in list_testbed_leftovers(id_part).values() for n in names} if re.match(r"^[0-9a-f]{0,6}$", id_part) else set()
    left = {kind: [n for n in names if n not in in_use and n not in live_testbeds] for kind, names in left.items()}
    if left["namespaces"] or left["links"]:
        raise FaultError(f"stale network leftovers could not be removed: {left}")
    return removed


__all__ = ["NetworkNamespace", "PartitionPlan", "cleanup_stale_namespaces", "list_leftovers", "partition_plan"]
