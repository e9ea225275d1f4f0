"""``ip`` plumbing under :mod:`leasekit.cluster.testbed`: commands, the lock and the rule every leasekit
address allocation on this host follows, namespace and link queries, and their removal. Needs root and
iproute2 (``ip``)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

NET_LOCK_PATH = "/run/lock/leasekit-netns.lock" if os.path.isdir("/run/lock") else "/tmp/leasekit-netns.lock"
"""The lock every leasekit address allocation on this host holds (testbeds and network namespaces)."""


class TestbedError(RuntimeError):
    """A testbed step failed (the message has the command and its stderr) or something it made
    survived its teardown."""

    __test__ = False  # not a pytest test class


def run(argv: list[str], *, check: bool = True, timeout_s: float = 15.0) -> subprocess.CompletedProcess:
    """Run ``argv`` (no shell). Raises TestbedError: ``check`` and it failed, or it hung ``timeout_s`` s."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"`{' '.join(argv)}` did not finish in {timeout_s} s") from exc
    except FileNotFoundError as exc:
        raise TestbedError(f"`{argv[0]}` not found (install iproute2): {exc}") from exc
    if check and result.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}")
    return result


@contextlib.contextmanager
def allocation_lock() -> Iterator[None]:
    """Hold :data:`NET_LOCK_PATH` (exclusive ``flock``) for one allocation: pick a subnet and
    configure its root-namespace address before another allocator looks."""
    with open(NET_LOCK_PATH, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def root_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network configured on an interface of the root (this) namespace."""
    used = []
    for line in run(["ip", "-o", "-4", "addr"]).stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return used


def free_subnet(pool: ipaddress.IPv4Network, prefixlen: int) -> ipaddress.IPv4Network:
    """The first ``/prefixlen`` of ``pool`` that overlaps no network of :func:`root_networks`. Call it
    under :func:`allocation_lock` and configure an address of the result before releasing the lock.

    Raises:
        TestbedError: none is free (the message says where to look for leftovers).
    """
    used = root_networks()
    for subnet in pool.subnets(new_prefix=prefixlen):
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise TestbedError(f"no free /{prefixlen} left in {pool} (check `ip -o addr` for leftovers; "
                       "`leasekit.cluster.testbed.cleanup_stale_testbeds()` removes a dead run's)")


def namespaces() -> list[str]:
    """Names of the network namespaces of this machine (``ip netns list``)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    """Pids of the processes inside namespace ``name`` (empty if it does not exist)."""
    result = run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in result.stdout.split()] if result.returncode == 0 else []


def links() -> list[str]:
    """Names of the network interfaces of the root namespace."""
    return [line.split(":")[1].strip().split("@")[0] for line in run(["ip", "-o", "link"]).stdout.splitlines()]


def wait(predicate, timeout_s: float) -> bool:
    """Poll ``predicate`` every 50 ms for up to ``timeout_s`` seconds; its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(0.05)
    return True


def remove_namespace(name: str, timeout_s: float = 5.0) -> None:
    """SIGKILL every process inside ``name`` and delete it; no-op if it is gone.

    Raises:
        TestbedError: a process survived SIGKILL for ``timeout_s`` s.
    """
    if name not in namespaces():
        return
    for pid in namespace_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not wait(lambda: not namespace_pids(name), timeout_s):
        raise TestbedError(f"processes {namespace_pids(name)} in namespace {name} survived SIGKILL")
    run(["ip", "netns", "del", name])


def remove_links(names: Sequence[str], *, last: Sequence[str] = (), timeout_s: float = 5.0) -> None:
    """Delete root-namespace links (those in ``last``, e.g. a bridge, after the others) and wait until
    they are gone.

    Raises:
        TestbedError: one is still there after ``timeout_s`` s.
    """
    for name in sorted(names, key=lambda n: (n in last, n)):
        if name in links():
            run(["ip", "link", "del", "dev", name], check=False)
    # a deleted namespace frees its veths asynchronously
    if not wait(lambda: not set(names) & set(links()), timeout_s):
        raise TestbedError(f"links {sorted(set(names) & set(links()))} still present {timeout_s} s after deleting them")
