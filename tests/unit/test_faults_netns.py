"""Network faults on a real network namespace: a TCP server inside, reached from the host over the
veth pair, then blocked (drop: connect times out; reject: refused at once), unblocked, and put
under random loss; destroy leaves no namespace, veth or process behind."""

import socket
import subprocess
import sys
import time
import uuid

import pytest

from leasekit.chaos.faults import FaultError
from leasekit.chaos.faults.netns import (
    NetworkNamespace,
    cleanup_stale_namespaces,
    list_leftovers,
)
from leasekit.chaos.faults.nft import NftFault
from leasekit.cluster.procs import wait_until

PORT = 18080
# A TCP server that accepts at once with a deep backlog. (`python -m http.server` keeps a backlog
# of 5 and accepts slowly: back-to-back connects overflow its queue, SYNs get dropped and connects
# time out with no fault at all - measured at 4 in 30 here.)
ACCEPT_LOOP = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1024)
while True:
    s.accept()[0].close()
"""


def _connect(host: str, port: int = PORT, timeout_s: float = 1.0) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        outcome = "ok"
    except ConnectionRefusedError:
        outcome = "refused"
    except TimeoutError:
        outcome = "timeout"
    return outcome, time.monotonic() - t0


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _gone(ns: NetworkNamespace) -> bool:
    return ns.name not in _ip("netns", "list") and ns.host_if not in _ip("link") and ns.ns_if not in _ip("link")


@pytest.fixture
def netns():
    ns = NetworkNamespace()
    yield ns
    ns.destroy()
    assert _gone(ns)


@pytest.fixture
def server(netns):
    cmd = [*netns.exec_prefix(), sys.executable, "-c", ACCEPT_LOOP, str(PORT)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _connect(netns.ns_ip, timeout_s=0.5)[0] == "ok", 15, 0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_namespace_has_a_veth_on_a_free_30(netns):
    assert netns.name.startswith("lk-") and netns.host_if == f"lkh{netns.short_id}"
    assert netns.exec_prefix() == ["ip", "netns", "exec", netns.name]
    assert netns.host_ip.startswith("10.237.") and netns.ns_ip.startswith("10.237.")
    assert f"inet {netns.host_ip}/30" in _ip("-o", "addr", "show", "dev", netns.host_if)
    inside = subprocess.run([*netns.exec_prefix(), "ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert f"inet {netns.ns_ip}/30" in inside and "127.0.0.1" in inside  # lo is up
    with NetworkNamespace() as other:  # a second one gets a different /30
        assert other.host_ip != netns.host_ip
    assert _gone(other)


def test_drop_times_out_and_unblock_restores(netns, server):
    handle = netns.block(PORT)
    outcome, elapsed = _connect(netns.ns_ip)
    assert outcome == "timeout" and elapsed >= 0.9
    netns.unblock(handle)
    assert _connect(netns.ns_ip)[0] == "ok"
    with pytest.raises(KeyError, match="handle"):
        netns.unblock(handle)


def test_reject_refuses_at_once_and_clear_rules_restores(netns, server):
    netns.block(PORT, action="reject")
    outcome, elapsed = _connect(netns.ns_ip)
    assert outcome == "refused" and elapsed < 0.5
    host_rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
    assert "leasekit" not in host_rules  # the rule lives in the namespace only
    netns.clear_rules()
    assert _connect(netns.ns_ip)[0] == "ok"
    netns.clear_rules()  # idempotent


def test_output_chain_drops_the_replies(netns, server):
    handle = netns.block(PORT, chain="output", match="sport")
    assert _connect(netns.ns_ip)[0] == "timeout"
    netns.unblock(handle)
    assert _connect(netns.ns_ip)[0] == "ok"


def test_random_loss_at_100_and_0_percent(netns, server):
    handle = netns.loss(PORT, 100)
    assert _connect(netns.ns_ip)[0] == "timeout"
    netns.unblock(handle)
    handle = netns.loss(PORT, 0)
    assert all(_connect(netns.ns_ip)[0] == "ok" for _ in range(50))
    netns.unblock(handle)


def test_nft_fault_injects_recovers_and_records(netns, server):
    fault = NftFault(netns, PORT, action="reject")
    try:
        fault.inject()
        assert _connect(netns.ns_ip)[0] == "refused"
        with pytest.raises(FaultError, match="already injected"):
            fault.inject()
        fault.recover()
        assert _connect(netns.ns_ip)[0] == "ok"
        assert fault.record["namespace"] == netns.name and fault.record["action"] == "reject"
        assert fault.record["recovered_monotonic_s"] >= fault.record["injected_monotonic_s"]
        fault.inject()
    finally:
        fault.cleanup()
        fault.cleanup()
    assert _connect(netns.ns_ip)[0] == "ok" and netns.rules() == {}


def test_arguments_are_validated_with_the_allowed_range(netns):
    cases = [
        (lambda: netns.block(0), "port must be an int in 1..65535"),
        (lambda: netns.block(65536), "port"),
        (lambda: netns.block("80"), "port"),
        (lambda: netns.block(80, action="accept"), "action must be one of"),
        (lambda: netns.block(80, chain="forward"), "chain must be one of"),
        (lambda: netns.block(80, protocol="icmp"), "protocol must be one of"),
        (lambda: netns.loss(80, 101), "percent must be an int in 0..100"),
        (lambda: netns.loss(80, -1), "percent"),
        (lambda: NftFault(netns, 80, mode="delay"), "mode must be one of"),
        (lambda: NetworkNamespace(short_id="Bad_Id"), "short_id"),
        (lambda: cleanup_stale_namespaces("docker"), "prefix must start with 'lk-'"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert netns.rules() == {}


def test_destroy_kills_what_runs_inside_and_is_idempotent():
    ns = NetworkNamespace()
    try:
        proc = subprocess.Popen([*ns.exec_prefix(), "sleep", "60"])
        assert wait_until(lambda: proc.pid in ns.pids(), 5, 0.05)
        ns.block(PORT)
        ns.destroy()
        assert proc.wait(timeout=5) == -9
        assert _gone(ns)
        ns.destroy()
    finally:
        ns.destroy()


def test_destroy_after_the_process_already_died():
    ns = NetworkNamespace()
    try:
        proc = subprocess.Popen([*ns.exec_prefix(), sys.executable, "-c", "pass"])
        proc.wait(timeout=10)
        ns.destroy()
        assert _gone(ns)
    finally:
        ns.destroy()


def test_cleanup_stale_namespaces_after_a_crash():
    short_id = "zz" + uuid.uuid4().hex[:6]
    ns = NetworkNamespace(short_id=short_id)  # then "crash": nobody destroys it
    proc = subprocess.Popen([*ns.exec_prefix(), "sleep", "60"])
    stray = f"zy{short_id[2:]}"  # a pair created but never moved into its namespace
    subprocess.run(["ip", "link", "add", f"lkh{stray}", "type", "veth", "peer", "name", f"lkn{stray}"], check=True)
    try:
        assert list_leftovers(f"lk-{short_id}")["namespaces"] == [ns.name]
        removed = cleanup_stale_namespaces(f"lk-{short_id}")
        assert ns.name in removed
        assert proc.wait(timeout=5) == -9
        assert _gone(ns)
        assert sorted(cleanup_stale_namespaces(f"lk-{stray}")) in ([f"lkh{stray}"], [f"lkh{stray}", f"lkn{stray}"])
        assert list_leftovers(f"lk-{stray}") == {"namespaces": [], "links": []}
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["ip", "link", "del", f"lkh{stray}"], capture_output=True, check=False)
        ns.destroy()


def test_a_sweep_leaves_another_live_runs_namespace_alone():
    """Two leasekit runs on one host: one run's stale sweep must not tear down the other's pair."""
    import subprocess as sp
    import sys

    from leasekit.chaos.faults import _common

    owner = sp.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ns = NetworkNamespace()
    try:
        with open(f"{_common.OWNERS_DIR}/{ns.name}", "w") as handle:  # as if `owner` had made it
            handle.write(str(owner.pid))
        cleanup_stale_namespaces()
        assert ns.name in list_leftovers()["namespaces"]
        owner.kill()
        owner.wait()
        assert ns.name in cleanup_stale_namespaces()  # its owner is gone: now it is stale
        assert ns.name not in list_leftovers()["namespaces"]
    finally:
        owner.kill()
        ns.destroy()
