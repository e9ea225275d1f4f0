"""Hosts on one machine: one network namespace per host, joined by a bridge in the root namespace.

``Testbed(["prefill", "decode"])`` makes, on a free /24 of :data:`POOL` (``10.237.128.0/17``):

- a bridge ``lkt<id>`` in the root namespace holding the gateway address ``.1`` (so the root
  namespace, where the router and the HTTP clients run, reaches every host);
- per host a network namespace ``lk-<id>-<host>`` with ``lo`` up and ``eth0`` (one end of a veth
  pair; the other end, ``lkt<id>v<i>``, is a port of the bridge) at ``.2``, ``.3``, ... in host order.

There is no default route inside a host: a host reaches the other hosts and the root namespace's
gateway address, nothing else, so traffic stays inside what the testbed made. Traffic between two
hosts crosses the bridge (a real link layer: ARP, TCP, retransmissions), so nftables rules inside a
host's namespace act on it like a host firewall would. Run a process on a host with
:meth:`Testbed.exec_prefix` (``ip netns exec lk-<id>-<host>``); it listens on ``0.0.0.0`` or on
:meth:`Testbed.address` and is reached at that address from the root namespace and the other hosts.

Addresses are allocated under the same lock as :class:`leasekit.chaos.faults.netns.NetworkNamespace`
(whose /30s come from ``10.237.0.0/17``) and both skip every network already configured in the root
namespace, so the two allocators never hand out overlapping addresses. Every namespace and the bridge
are claimed (:mod:`leasekit.cluster.owners`): :func:`cleanup_stale_testbeds` removes what a dead run
left and never what a live one uses. Needs root and iproute2 (``ip``).

Note: with ``br_netfilter`` loaded and ``net.bridge.bridge-nf-call-iptables = 1``, traffic between the
hosts also passes the root namespace's iptables/nftables ``FORWARD`` hook; a host firewall that drops
forwarded packets (Docker sets that policy) would cut the hosts off from each other.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from collections.abc import Sequence
from typing import Self

from leasekit.cluster.iproute import (  # noqa: F401 - NET_LOCK_PATH and free_subnet are this module's API too
    NET_LOCK_PATH,
    TestbedError,
    allocation_lock,
    free_subnet,
    links,
    namespace_pids,
    namespaces,
    remove_links,
    remove_namespace,
    run,
)
from leasekit.cluster.owners import claim, owned_by_another_live_process, unclaim

POOL = ipaddress.ip_network("10.237.128.0/17")
"""Where testbed subnets (/24 each) come from."""

NAMESPACE_PREFIX = "lk-"
LINK_PREFIX = "lkt"
HOST_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
ID_RE = re.compile(r"^[0-9a-f]{6}$")
MAX_HOSTS = 16


class Testbed:
    """Hosts on this machine, each in its own network namespace, joined by a bridge (module doc).

    Created by the constructor (undone if any step fails); use it as a context manager or call
    :meth:`destroy` (idempotent). Attributes: ``id`` (6 hex digits), ``bridge``, ``subnet`` (an
    ``IPv4Network``), ``gateway`` (the root namespace's address on the bridge), ``hosts`` (names, in
    order).

    Args:
        hosts: 1..16 distinct names of ``[a-z][a-z0-9]{0,15}``, e.g. ``["prefill", "decode"]``.
        short_id: 6 lowercase hex digits; default random.

    Raises:
        ValueError: ``hosts`` or ``short_id`` malformed (the message names the rule).
        TestbedError: a step failed (the message has the command and its stderr); nothing is left.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: Sequence[str], *, short_id: str | None = None):
        hosts = list(hosts) if not isinstance(hosts, str) else [hosts]
        if not 1 <= len(hosts) <= MAX_HOSTS:
            raise ValueError(f"hosts: 1..{MAX_HOSTS} host names, got {len(hosts)}")
        for host in hosts:
            if not isinstance(host, str) or not HOST_RE.match(host):
                raise ValueError(f"hosts: each name must match {HOST_RE.pattern} (e.g. 'prefill'), got {host!r}")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts: names must be distinct, got {hosts}")
        short_id = uuid.uuid4().hex[:6] if short_id is None else short_id
        if not isinstance(short_id, str) or not ID_RE.match(short_id):
            raise ValueError(f"short_id must be 6 lowercase hex digits, got {short_id!r}")
        self.id, self.hosts = short_id, tuple(hosts)
        self.bridge = f"{LINK_PREFIX}{short_id}"
        self._namespaces = {h: f"{NAMESPACE_PREFIX}{short_id}-{h}" for h in hosts}
        self._veths = {h: f"{LINK_PREFIX}{short_id}v{i}" for i, h in enumerate(hosts)}
        self._addresses: dict[str, str] = {}
        self._made_namespaces: list[str] = []  # destroy removes only what this instance made
        self._made_links: list[str] = []
        self._claimed: list[str] = []
        self.destroyed = False
        taken = [n for n in self._namespaces.values() if n in namespaces()] + ([self.bridge] if self.bridge in links() else [])
        if taken or owned_by_another_live_process(self.bridge):
            raise TestbedError(f"testbed id {short_id!r} is in use ({taken or 'claimed by a live process'}); leave short_id out for a fresh one")
        self._claim(self.bridge)  # before anything exists: a concurrent sweep must see it as live
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise

    def _claim(self, name: str) -> None:
        claim(name)
        self._claimed.append(name)

    def _step(self, argv: list[str]) -> None:
        """Run one build step and remember what it made."""
        run(argv)
        if argv[:3] == ["ip", "netns", "add"]:
            self._made_namespaces.append(argv[3])
        elif argv[:3] == ["ip", "link", "add"]:
            self._made_links += [argv[3], *(argv[-1:] if "peer" in argv else [])]

    def _build(self) -> None:
        with allocation_lock():  # the subnet is taken once the bridge holds its gateway address
            self.subnet = free_subnet(POOL, 24)
            addresses = [str(a) for a in self.subnet.hosts()]
            self.gateway = addresses[0]
            steps = build_steps(self.id, self.hosts, self.gateway, addresses[1:len(self.hosts) + 1], self.subnet.prefixlen)
            for argv, _ in steps[:2]:
                self._step(argv)
        for host in self.hosts:
            self._claim(self._namespaces[host])
        for argv, _ in steps[2:]:
            self._step(argv)
        self._addresses = dict(zip(self.hosts, addresses[1:]))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"Testbed({list(self.hosts)!r}, id={self.id!r}, subnet={str(getattr(self, 'subnet', '?'))!r})"

    def _check(self, host: str) -> None:
        if host not in self._namespaces:
            raise KeyError(f"host {host!r} is not in this testbed (hosts: {list(self.hosts)})")

    def address(self, host: str) -> str:
        """The IPv4 address (dotted text) of ``host``'s ``eth0``; the others and the root namespace
        reach it there. Raises KeyError: unknown host."""
        self._check(host)
        return self._addresses[host]

    def namespace(self, host: str) -> str:
        """The network namespace name of ``host`` (``lk-<id>-<host>``). Raises KeyError: unknown host."""
        self._check(host)
        return self._namespaces[host]

    def exec_prefix(self, host: str) -> list[str]:
        """Prefix a command with this to run it on ``host``: ``["ip", "netns", "exec", NAMESPACE]``.
        Raises KeyError: unknown host."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def pids(self, host: str) -> list[int]:
        """Pids of the live processes on ``host``. Raises KeyError: unknown host."""
        return namespace_pids(self.namespace(host))

    def describe(self) -> dict:
        """``{"id", "bridge", "subnet", "gateway", "hosts": {name: {"namespace", "address"}}}`` for
        reports and logs."""
        return {"id": self.id, "bridge": self.bridge, "subnet": str(getattr(self, "subnet", "")),
                "gateway": getattr(self, "gateway", None),
                "hosts": {h: {"namespace": self._namespaces[h], "address": self._addresses.get(h)} for h in self.hosts}}

    def destroy(self) -> None:
        """SIGKILL every process on every host, delete the namespaces, veths and the bridge;
        idempotent (also after a partial construction).

        Raises:
            TestbedError: something survived (the message says what); a retry may succeed.
        """
        for name in self._made_namespaces:
            remove_namespace(name)
        remove_links(self._made_links, last=[self.bridge])
        for name in self._claimed:
            unclaim(name)
        self._made_namespaces, self._made_links, self._claimed = [], [], []
        self._addresses.clear()
        self.destroyed = True


def build_steps(short_id: str, hosts: Sequence[str], gateway: str, addresses: Sequence[str],
                prefixlen: int) -> list[tuple[list[str], str]]:
    """The ``ip`` commands that build a testbed, in order, each with what it does: ``(argv, what)``.
    :class:`Testbed` runs exactly these (the first two under :func:`allocation_lock`);
    :class:`PlannedTestbed` shows them. ``addresses``: one per host, in host order."""
    bridge = f"{LINK_PREFIX}{short_id}"
    steps = [(["ip", "link", "add", bridge, "type", "bridge"], "the bridge joining the hosts (root namespace)"),
             (["ip", "addr", "add", f"{gateway}/{prefixlen}", "dev", bridge], "the root namespace's address on it (reaches every host)"),
             (["ip", "link", "set", bridge, "up"], "bridge up")]
    for i, (host, address) in enumerate(zip(hosts, addresses)):
        ns, veth, peer = f"{NAMESPACE_PREFIX}{short_id}-{host}", f"{LINK_PREFIX}{short_id}v{i}", f"{LINK_PREFIX}{short_id}p{i}"
        steps += [(["ip", "netns", "add", ns], f"host {host}: its network namespace"),
                  (["ip", "-n", ns, "link", "set", "lo", "up"], "loopback up"),
                  (["ip", "link", "add", veth, "type", "veth", "peer", "name", peer], "a veth pair"),
                  (["ip", "link", "set", peer, "netns", ns], "one end into the host"),
                  (["ip", "-n", ns, "link", "set", peer, "name", "eth0"], "named eth0 there"),
                  (["ip", "-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0"], f"host {host}'s address"),
                  (["ip", "-n", ns, "link", "set", "eth0", "up"], "eth0 up"),
                  (["ip", "link", "set", veth, "master", bridge], "the other end on the bridge"),
                  (["ip", "link", "set", veth, "up"], "bridge port up")]
    return steps


class PlannedTestbed:
    """Stands in for a :class:`Testbed` in a plan (``leasekit chaos run --plan``): the same names and
    read API with placeholders for what is only chosen at start (``<id>``, the addresses), and the
    commands a real one runs; creates and executes nothing."""

    __test__ = False

    def __init__(self, hosts: Sequence[str]):
        self.id, self.hosts = "<id>", tuple(hosts)
        self.bridge = f"{LINK_PREFIX}<id>"
        self.subnet = f"<a free /24 of {POOL}>"
        self.gateway = "<gateway .1>"
        self.destroyed = False

    def address(self, host: str) -> str:
        """``<HOST address>`` (``.2``, ``.3``, ... of the subnet, in host order)."""
        return f"<{host} address>"

    def namespace(self, host: str) -> str:
        """``lk-<id>-HOST``."""
        return f"{NAMESPACE_PREFIX}<id>-{host}"

    def exec_prefix(self, host: str) -> list[str]:
        """``["ip", "netns", "exec", "lk-<id>-HOST"]``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def create_steps(self) -> list[tuple[list[str], str]]:
        """What :class:`Testbed` runs to build itself (see :func:`build_steps`)."""
        return build_steps("<id>", self.hosts, self.gateway, [self.address(h) for h in self.hosts], 24)

    def destroy_steps(self) -> list[tuple[list[str], str]]:
        """What :meth:`Testbed.destroy` runs."""
        steps = []
        for host in self.hosts:
            ns = self.namespace(host)
            steps += [(["kill", "-KILL", f"<each pid of `ip netns pids {ns}`>"], f"kill what is left on host {host}"),
                      (["ip", "netns", "del", ns], f"delete host {host} (its veth goes with it)")]
        return steps + [(["ip", "link", "del", "dev", self.bridge], "delete the bridge")]

    def destroy(self) -> None:
        """Nothing to undo."""


def _testbed_of(name: str) -> str | None:
    """The testbed id a namespace (``lk-<id>-<host>``) or link (``lkt<id>...``) belongs to, else None."""
    if name.startswith(NAMESPACE_PREFIX):
        found = re.match(r"^lk-([0-9a-f]{6})-[a-z][a-z0-9]*$", name)
    else:
        found = re.match(r"^lkt([0-9a-f]{6})(?:[vp]\d+)?$", name)
    return found.group(1) if found else None


def list_testbed_leftovers(id_prefix: str = "") -> dict[str, list[str]]:
    """``{"namespaces": [...], "links": [...]}``: testbed namespaces and root-namespace links present
    now whose testbed id starts with ``id_prefix`` (live testbeds included).

    Raises:
        ValueError: ``id_prefix`` is not 0..6 lowercase hex digits.
    """
    if not re.match(r"^[0-9a-f]{0,6}$", id_prefix):
        raise ValueError(f"id_prefix must be 0..6 lowercase hex digits, got {id_prefix!r}")
    ours = lambda name: (tid := _testbed_of(name)) is not None and tid.startswith(id_prefix)  # noqa: E731
    return {"namespaces": [n for n in namespaces() if ours(n)], "links": [n for n in links() if ours(n)]}


def cleanup_stale_testbeds(id_prefix: str = "") -> list[str]:
    """Remove what dead runs' testbeds left (processes, namespaces, veths, bridges); a testbed whose
    bridge or a namespace another live process claimed is left alone. Returns what was removed.

    Raises:
        ValueError: ``id_prefix`` malformed.
        TestbedError: something could not be removed.
    """
    found = list_testbed_leftovers(id_prefix)
    ids = {_testbed_of(n) for names in found.values() for n in names}
    live = {tid for tid in ids if owned_by_another_live_process(f"{LINK_PREFIX}{tid}")
            or any(owned_by_another_live_process(n) for n in found["namespaces"] if _testbed_of(n) == tid)}
    removed = []
    for tid in sorted(ids - live):
        for name in [n for n in found["namespaces"] if _testbed_of(n) == tid]:
            remove_namespace(name)
            unclaim(name)
            removed.append(name)
        stale_links = [n for n in found["links"] if _testbed_of(n) == tid]
        remove_links(stale_links, last=[f"{LINK_PREFIX}{tid}"])
        unclaim(f"{LINK_PREFIX}{tid}")
        removed.extend(stale_links)
    return removed
