"""``ip``/``nft`` plumbing for :mod:`leasekit.chaos.faults.netns`: names, argument checks,
namespace/link queries, /30 allocation and teardown."""

from __future__ import annotations

import ipaddress
import os
import re
import signal

from leasekit.chaos.faults._common import FaultError, run, wait_for
from leasekit.cluster.testbed import NET_LOCK_PATH, TestbedError
from leasekit.cluster.testbed import free_subnet as _free_subnet

PREFIX = "lk-"
# /30s for NetworkNamespace; two-host testbeds take /24s of 10.237.128.0/17 (leasekit.cluster.testbed),
# under the same lock and the same "overlaps nothing configured in the root namespace" rule
POOL = ipaddress.ip_network("10.237.0.0/17")
ACTIONS = ("drop", "reject")
CHAINS = ("input", "output")
PROTOCOLS = ("tcp", "udp")
MATCHES = ("dport", "sport")
LOCK_PATH = NET_LOCK_PATH
ID_RE = re.compile(r"^[a-z0-9]{1,12}$")
TABLE = ("inet", "leasekit")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return value


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def namespaces() -> list[str]:
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ns_pids(name: str) -> list[int]:
    result = run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in result.stdout.split()] if result.returncode == 0 else []


def free_subnet() -> ipaddress.IPv4Network:
    """The first /30 of :data:`POOL` that overlaps no address configured on this host (call it while
    holding :data:`LOCK_PATH`, the lock testbeds allocate under too).

    Raises:
        FaultError: none is left.
    """
    try:
        return _free_subnet(POOL, 30)
    except TestbedError as exc:
        raise FaultError(str(exc)) from None


def teardown(name: str, host_if: str | None, timeout_s: float = 5.0) -> None:
    """Kill the namespace's processes, delete the host veth (if ``host_if``) and the namespace;
    idempotent."""
    if name in namespaces():
        for pid in ns_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not wait_for(lambda: not ns_pids(name), timeout_s, 0.05):
            raise FaultError(f"processes {ns_pids(name)} in namespace {name} survived SIGKILL")
    if host_if and link_exists(host_if):
        run(["ip", "link", "del", "dev", host_if], check=False)
    if name in namespaces():
        run(["ip", "netns", "del", name])
    # deleting a namespace frees its devices asynchronously: wait until the pair is really gone
    if host_if and not wait_for(lambda: not link_exists(host_if), timeout_s, 0.05):
        raise FaultError(f"veth {host_if} still present {timeout_s} s after deleting {name}")
