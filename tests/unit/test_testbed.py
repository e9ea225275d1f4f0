"""Hosts on one machine, for real: two network namespaces on a bridge reach each other and are
reached from the root namespace over TCP; addresses never overlap what is configured; destroy and the
stale sweep leave nothing behind, and a sweep never touches a live run's testbed. Needs root and ``ip``."""

import ipaddress
import socket
import subprocess
import sys
import time
import uuid

import pytest

from leasekit.cluster import owners
from leasekit.cluster.procs import wait_until
from leasekit.cluster.testbed import (
    POOL,
    PlannedTestbed,
    Testbed,
    TestbedError,
    cleanup_stale_testbeds,
    list_testbed_leftovers,
)

PORT = 18090
SERVE_ONCE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(16)
while True:
    c, peer = s.accept()
    c.sendall(peer[0].encode())
    c.close()
"""
ASK = "import socket, sys; print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).recv(64).decode())"


def _gone(bed: Testbed) -> bool:
    left = list_testbed_leftovers(bed.id)
    return left == {"namespaces": [], "links": []}


@pytest.fixture
def bed():
    with Testbed(["prefill", "decode"]) as testbed:
        yield testbed
    assert _gone(testbed)


def _serve(bed: Testbed, host: str) -> subprocess.Popen:
    proc = subprocess.Popen([*bed.exec_prefix(host), sys.executable, "-c", SERVE_ONCE, str(PORT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_until(lambda: _reach(bed.address(host)) is not None, 15, 0.1)
    return proc


def _reach(address: str) -> str | None:
    """What the server at ``address`` says it saw as our address, or None."""
    try:
        with socket.create_connection((address, PORT), timeout=1) as conn:
            return conn.recv(64).decode()
    except OSError:
        return None


def test_hosts_have_their_own_addresses_and_reach_each_other_across_the_bridge(bed):
    assert bed.hosts == ("prefill", "decode")
    assert bed.namespace("decode") == f"lk-{bed.id}-decode" and bed.exec_prefix("decode") == ["ip", "netns", "exec", bed.namespace("decode")]
    assert bed.subnet.subnet_of(POOL) and bed.subnet.prefixlen == 24
    assert [bed.gateway, bed.address("prefill"), bed.address("decode")] == [str(a) for a in list(bed.subnet.hosts())[:3]]
    inside = subprocess.run([*bed.exec_prefix("decode"), "ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    assert f"eth0    inet {bed.address('decode')}/24" in inside and "lo    inet 127.0.0.1/8" in inside
    routes = subprocess.run([*bed.exec_prefix("decode"), "ip", "route"], capture_output=True, text=True, check=True).stdout
    assert "default" not in routes  # a host reaches the testbed and nothing else
    server = _serve(bed, "prefill")
    try:
        # the root namespace reaches the host from the bridge address; the other host from its own
        assert _reach(bed.address("prefill")) == bed.gateway
        seen = subprocess.run([*bed.exec_prefix("decode"), sys.executable, "-c", ASK, bed.address("prefill"), str(PORT)],
                              capture_output=True, text=True, timeout=30)
        assert seen.stdout.strip() == bed.address("decode"), seen.stderr
        assert server.pid in bed.pids("prefill") and server.pid not in bed.pids("decode")
    finally:
        server.kill()
        server.wait()
    with pytest.raises(KeyError, match="host 'router' is not in this testbed"):
        bed.address("router")


def test_destroy_kills_what_runs_on_the_hosts_and_is_idempotent():
    bed = Testbed(["a", "b", "c"])
    try:
        proc = subprocess.Popen([*bed.exec_prefix("c"), "sleep", "60"])
        assert wait_until(lambda: proc.pid in bed.pids("c"), 5, 0.05)
        assert len(list_testbed_leftovers(bed.id)["links"]) == 4  # bridge + one veth per host
        bed.destroy()
        assert proc.wait(timeout=5) == -9
        assert _gone(bed) and bed.destroyed
        bed.destroy()
    finally:
        bed.destroy()


def test_a_subnet_in_use_in_the_root_namespace_is_skipped():
    dummy = f"lkz{uuid.uuid4().hex[:8]}"
    with Testbed(["x"]) as probe:  # the /24 the next testbed would take
        taken = probe.subnet
    subprocess.run(["ip", "link", "add", dummy, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{list(taken.hosts())[-1]}/24", "dev", dummy], check=True)
        with Testbed(["x"]) as bed:
            assert not bed.subnet.overlaps(taken)
    finally:
        subprocess.run(["ip", "link", "del", dummy], check=False)


def test_the_namespace_allocator_and_the_testbed_never_overlap():
    from leasekit.chaos.faults.netns import NetworkNamespace

    with Testbed(["x"]) as bed, NetworkNamespace() as ns:
        assert not bed.subnet.overlaps(ipaddress.ip_interface(f"{ns.host_ip}/30").network)


def test_arguments_are_validated():
    for hosts, message in [([], "1..16 host names"), (["P"], "must match"), (["a", "a"], "distinct"),
                           (["x" * 17], "must match"), ([f"h{i}" for i in range(17)], "1..16")]:
        with pytest.raises(ValueError, match=message):
            Testbed(hosts)
    with pytest.raises(ValueError, match="short_id must be 6 lowercase hex digits"):
        Testbed(["a"], short_id="zzzzzz")
    with pytest.raises(ValueError, match="id_prefix"):
        list_testbed_leftovers("not-hex")


def test_a_failed_build_removes_what_it_made_and_nothing_else():
    short_id = uuid.uuid4().hex[:6]
    stray = f"lkt{short_id}v1"  # in the way of the second host's veth
    subprocess.run(["ip", "link", "add", stray, "type", "bridge"], check=True)
    try:
        with pytest.raises(TestbedError, match=f"ip link add {stray} type veth"):
            Testbed(["a", "b"], short_id=short_id)
        assert list_testbed_leftovers(short_id) == {"namespaces": [], "links": [stray]}
    finally:
        subprocess.run(["ip", "link", "del", stray], check=False)
    with Testbed(["a"]) as first:
        with pytest.raises(TestbedError, match="is in use"):
            Testbed(["a"], short_id=first.id)
        assert not _gone(first)  # the refused one took nothing of the first one's down


def test_the_stale_sweep_removes_a_dead_runs_testbed_and_leaves_a_live_one():
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bed = Testbed(["prefill", "decode"])
    try:
        proc = subprocess.Popen([*bed.exec_prefix("decode"), "sleep", "60"])
        for name in (bed.bridge, bed.namespace("prefill"), bed.namespace("decode")):  # as if `owner` had made it
            with open(f"{owners.OWNERS_DIR}/{name}", "w") as handle:
                handle.write(str(owner.pid))
        assert cleanup_stale_testbeds(bed.id) == [] and not _gone(bed)
        owner.kill()
        owner.wait()
        time.sleep(0.1)
        removed = cleanup_stale_testbeds(bed.id)  # its owner is gone: now it is stale
        assert set(removed) == {bed.namespace("prefill"), bed.namespace("decode"), bed.bridge, f"lkt{bed.id}v0", f"lkt{bed.id}v1"}
        assert proc.wait(timeout=5) == -9 and _gone(bed)
    finally:
        owner.kill()
        bed.destroy()


def test_the_namespace_sweep_covers_testbeds_too():
    from leasekit.chaos.faults.netns import cleanup_stale_namespaces, list_leftovers

    bed = Testbed(["a"])
    try:
        found = list_leftovers(f"lk-{bed.id}")
        assert found["namespaces"] == [bed.namespace("a")] and set(found["links"]) == {bed.bridge, f"lkt{bed.id}v0"}
        assert bed.bridge in cleanup_stale_namespaces(f"lk-{bed.id}")  # this process made it: not "another live run"
        assert _gone(bed)
    finally:
        bed.destroy()


def test_a_planned_testbed_shows_the_real_commands_and_creates_nothing():
    before = list_testbed_leftovers()
    plan = PlannedTestbed(["prefill", "decode"])
    steps = [" ".join(argv) for argv, _ in plan.create_steps()]
    assert steps[0] == "ip link add lkt<id> type bridge"
    assert "ip -n lk-<id>-decode addr add <decode address>/24 dev eth0" in steps
    assert plan.exec_prefix("decode") == ["ip", "netns", "exec", "lk-<id>-decode"]
    assert [argv[:3] for argv, _ in plan.destroy_steps()][-1] == ["ip", "link", "del"]
    assert list_testbed_leftovers() == before
