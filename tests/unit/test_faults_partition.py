"""Partitions between two testbed hosts, on real TCP: a server on the prefill host, clients on the
decode host. ``all`` cuts new and established connections both ways; one way loses only what that
side sends (its peer's data still arrives, acknowledged); ``nixl`` spares the side-channel port;
``reject`` refuses at once; the injector counts what it matched and leaves nothing behind. Needs
root, ``ip`` and ``nft``."""

import subprocess
import sys
import time

import pytest

from leasekit.chaos.faults import FaultError
from leasekit.chaos.faults.partition import PartitionInjector, PartitionSite, partition_rules
from leasekit.cluster.procs import wait_until
from leasekit.cluster.testbed import Testbed

SIDE, DATA_PORT = 18101, 18102
SERVER = """
import socket, sys, threading
def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=talk, args=(c,), daemon=True).start()
def talk(c):  # answer "ok"; on "stream", send a numbered line every 0.1 s; log what arrives
    try:
        while True:
            data = c.recv(64)
            if not data:
                return
            print("got", data.decode().strip(), flush=True)
            if data.startswith(b"stream"):
                for i in range(1000):
                    c.sendall(b"%d;" % i)
                    __import__("time").sleep(0.1)
            c.sendall(b"ok")
    except OSError:
        pass
for port in map(int, sys.argv[1:]):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
threading.Event().wait()
"""
CONNECT = """
import socket, sys, time
t0 = time.monotonic()
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.sendall(b"hello")
    print("ok" if c.recv(2) == b"ok" else "closed")
except ConnectionRefusedError:
    print("refused")
except ConnectionResetError:
    print("reset")
except (TimeoutError, socket.timeout):
    print("timeout")
print(round(time.monotonic() - t0, 2))
"""


@pytest.fixture(scope="module")
def bed():
    with Testbed(["prefill", "decode"]) as testbed:
        server = subprocess.Popen([*testbed.exec_prefix("prefill"), sys.executable, "-u", "-c", SERVER, str(SIDE), str(DATA_PORT)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert wait_until(lambda: connect(testbed, DATA_PORT, 0.5)[0] == "ok", 15, 0.1)
            yield testbed
        finally:
            server.kill()
            server.wait()


def connect(bed, port, timeout_s=1.0):
    """From the decode host to the prefill host: (outcome, seconds)."""
    out = subprocess.run([*bed.exec_prefix("decode"), sys.executable, "-c", CONNECT, bed.address("prefill"), str(port), str(timeout_s)],
                         capture_output=True, text=True, timeout=30).stdout.split()
    return out[0], float(out[1])


def injector(bed, path, direction="both", action="drop", target="prefill"):
    site = PartitionSite(bed.address("prefill"), bed.address("decode"), bed.namespace("prefill"), bed.namespace("decode"),
                         SIDE, 1, 8000, 8001)
    return PartitionInjector(site.namespace(target), partition_rules(path, direction, action, 100, target, site))


def test_all_cuts_both_ways_and_is_counted_and_lifted(bed):
    fault = injector(bed, "all")
    fault.inject()
    try:
        assert connect(bed, DATA_PORT)[0] == "timeout" and connect(bed, SIDE)[0] == "timeout"
        assert fault.packets() >= 2
        with pytest.raises(FaultError, match="already injected"):
            fault.inject()
    finally:
        fault.cleanup()
    assert fault.record["packets_matched"] >= 2 and fault.record["recovered_monotonic_s"] >= fault.record["injected_monotonic_s"]
    # the interval the rules surely held lies inside the one around both nft commands
    r = fault.record
    assert r["injected_monotonic_s"] <= r["in_force_monotonic_s"] <= r["lifting_monotonic_s"] <= r["recovered_monotonic_s"]
    assert connect(bed, DATA_PORT)[0] == "ok"
    fault.cleanup()  # idempotent
    listing = subprocess.run([*bed.exec_prefix("prefill"), "nft", "list", "table", "inet", "leasekit"], capture_output=True, text=True).stdout
    assert "drop" not in listing  # every rule gone (the empty table may stay)
    host_rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
    assert "leasekit" not in host_rules  # never in the root namespace


def test_nixl_spares_the_side_channel(bed):
    with_rules(bed, injector(bed, "nixl"), lambda: (connect(bed, SIDE)[0], connect(bed, DATA_PORT)[0]) == ("ok", "timeout"))


def test_reject_refuses_at_once(bed):
    def refused():
        outcome, seconds = connect(bed, DATA_PORT, 3.0)
        return outcome in ("refused", "reset") and seconds < 1.0
    with_rules(bed, injector(bed, "all", action="reject"), refused)
    with_rules(bed, injector(bed, "all", action="reject", target="decode"), refused)


def with_rules(bed, fault, check):
    fault.inject()
    try:
        assert check()
    finally:
        fault.recover()


STREAM = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.sendall(b"stream")
open(sys.argv[3], "w").write("connected\\n")
c.settimeout(0.2)
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    try:
        data = c.recv(4096)
    except (TimeoutError, socket.timeout):
        continue
    with open(sys.argv[3], "a") as log:
        log.write("%.2f %s\\n" % (time.monotonic(), data.decode()))
"""


@pytest.mark.parametrize("target", ["prefill", "decode"])
def test_one_way_loses_only_what_one_side_sends(bed, tmp_path, target):
    """P streams to D over a connection D opened; with D -> P data lost, P's stream keeps arriving
    (D's bare ACKs pass) while D's own sends never reach P; with P -> D lost the stream stops."""
    log = tmp_path / "stream.log"
    client = subprocess.Popen([*bed.exec_prefix("decode"), sys.executable, "-c", STREAM, bed.address("prefill"), str(DATA_PORT), str(log), "6"])
    try:
        assert wait_until(lambda: log.exists() and log.read_text().count(";") >= 5, 10, 0.1)
        fault = injector(bed, "all", direction="decode_to_prefill", target=target)
        fault.inject()
        try:
            before = log.read_text().count(";")
            time.sleep(1.5)  # ~15 more lines if P's sends still arrive and are acknowledged
            arrived = log.read_text().count(";") - before
            assert arrived >= 8, f"P -> D stalled under a D -> P partition: {arrived} line(s) in 1.5 s"
            assert connect(bed, DATA_PORT)[0] == "timeout"  # what D sends ("hello") never arrives
        finally:
            fault.recover()
        assert fault.record["packets_matched"] >= 1
        fault = injector(bed, "all", direction="prefill_to_decode", target=target)
        fault.inject()
        try:
            time.sleep(0.5)
            before = log.read_text().count(";")
            time.sleep(1.5)
            assert log.read_text().count(";") == before, "P's stream still arrived under a P -> D partition"
        finally:
            fault.recover()
        assert fault.record["packets_matched"] >= 3
    finally:
        client.kill()
        client.wait()
